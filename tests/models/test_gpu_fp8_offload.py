"""FP8 weights and CPU offloading on CUDA (skipped without it): `torch._scaled_mm` against the
float32 reference path on the same weights, fp8 under CUDA graphs against eager, and offloaded
layers (side-stream copies, recorded into CUDA graphs) giving the same logits and tokens as the
model without offloading, with the copies' time measured."""

from __future__ import annotations

import time

import pytest
import torch
import transformers

from llmserve import LLM, SamplingParams
from llmserve.config import ModelConfig
from llmserve.layers.quantization import Fp8Linear
from llmserve.layers.quantization.fp8 import scaled_mm_supported
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.model_loader import load_model
from tests.models.tiny import _LLAMA_LIKE, make_tiny_model, save_tiny_tokenizer

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

PROMPT = [200, 1, 1, 45, 67, 300, 12, 9, 8, 7, 6, 5, 4, 3, 2, 11, 400, 401, 402, 25]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
needs_fp8 = pytest.mark.skipif(
    not scaled_mm_supported(torch.device("cuda")), reason="FP8 tensor cores need compute capability >= 8.9"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu-fp8")
    make_tiny_model("llama", folder)
    return folder


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A tiny Llama with 8 layers, hidden 256 (a layer is ~1.3 MiB in bf16)."""
    folder = tmp_path_factory.mktemp("gpu-offload")
    torch.manual_seed(0)
    shape = {**_LLAMA_LIKE, "num_hidden_layers": 8, "hidden_size": 256, "intermediate_size": 512}
    config = transformers.LlamaConfig(**shape, tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return folder


def _logits(loaded) -> torch.Tensor:
    runner = ForwardRunner(loaded.model, num_blocks=8, block_size=4, profile=loaded.profile)
    return runner.execute([SequenceBatchEntry(PROMPT, len(PROMPT), list(range(5)))], all_logits=True).float()


@needs_fp8
def test_scaled_mm_matches_the_reference_path(tiny):
    loaded = load_model(
        ModelConfig(model=str(tiny), device="cuda", dtype="bfloat16", quantization="fp8", show_progress=False)
    )
    layers = [m for m in loaded.model.modules() if isinstance(m, Fp8Linear)]
    assert layers and all(m.kernel == "scaled_mm" for m in layers)
    assert "torch._scaled_mm" in loaded.linear_kernel
    # each matmul: the same e4m3 products with float32 sums, so the tensor cores' bf16 output is
    # the reference's float32 result rounded (sums in another order: a unit of bf16 at most)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m in layers:
        x = torch.randn(7, m.in_features, device="cuda", generator=gen, dtype=torch.bfloat16)
        fast = m(x)
        m.kernel = "reference"
        ref = m(x)
        m.kernel = "scaled_mm"
        torch.testing.assert_close(fast, ref, rtol=2**-7, atol=1e-3 * ref.abs().max().item())
    # the whole model: a bf16 rounding that flips between the two moves the next layer's e4m3
    # rounding of that activation (16 times coarser), so differences grow through the layers (an
    # H100 run: largest 0.27 beside logits up to 5.1), yet stay a small part of the logits
    fast = _logits(loaded)
    for m in layers:
        m.kernel = "reference"
    ref = _logits(loaded)
    assert (fast - ref).abs().max() <= 0.1 * ref.abs().max()
    assert (fast.argmax(-1) != ref.argmax(-1)).sum() <= 1  # of 20 positions


def test_fp8_on_cuda_is_the_cpu_reference(tiny):
    """The whole CUDA stack (Triton attention, fused norms and SiLU-mul) over fp8 layers on the
    reference kernel, float32: the CPU's fp8 numbers, up to a rare e4m3 rounding flip."""
    cuda = load_model(
        ModelConfig(model=str(tiny), device="cuda", dtype="float32", quantization="fp8", show_progress=False)
    )
    for m in cuda.model.modules():
        if isinstance(m, Fp8Linear):
            m.kernel = "reference"
    cpu = load_model(ModelConfig(model=str(tiny), device="cpu", quantization="fp8", show_progress=False))
    diff = (_logits(cuda).cpu() - _logits(cpu)).abs()
    assert diff.max() < 0.1 and (diff > 1e-3).float().mean() < 0.05


@needs_fp8
def test_fp8_graphs_match_eager(tiny):
    kw = dict(
        device="cuda",
        dtype="bfloat16",
        quantization="fp8",
        num_kv_blocks=128,
        block_size=4,
        show_progress=False,
    )
    graphs = LLM(str(tiny), **kw).generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
    eager = LLM(str(tiny), enforce_eager=True, **kw).generate(
        [{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False
    )
    assert graphs[0].outputs[0].token_ids == eager[0].outputs[0].token_ids


def test_offloaded_logits_are_bitwise_the_resident_ones(deep):
    kw = dict(model=str(deep), device="cuda", dtype="bfloat16", show_progress=False)
    want = _logits(load_model(ModelConfig(**kw)))
    loaded = load_model(ModelConfig(cpu_offload_gb=4 * 1.4 / 1024, **kw))
    assert loaded.offloader is not None and len(loaded.offloader.offloaded) >= 2
    assert all(h.is_pinned() for h in loaded.offloader.host)
    assert torch.equal(_logits(loaded), want)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_offloaded_engine_generates_the_same_tokens(deep, enforce_eager):
    """Under CUDA graphs the copies are replayed with the kernels; eagerly they run on the side stream."""
    kw = dict(device="cuda", dtype="bfloat16", num_kv_blocks=256, block_size=4, show_progress=False,
              enforce_eager=enforce_eager, max_num_seqs=8)  # fmt: skip
    prompts = [{"prompt_token_ids": PROMPT[: 5 + i]} for i in range(6)]
    want = LLM(str(deep), **kw).generate(prompts, GREEDY, use_tqdm=False)
    got = LLM(str(deep), cpu_offload_gb=6 * 1.4 / 1024, **kw).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_offload_time_is_measured_and_pays_for_the_copies(deep):
    """Each forward re-reads every offloaded byte over PCIe: the step takes at least that long
    more than the resident one (at most 64 GB/s, PCIe 5 x16); the figures are printed."""
    kw = dict(model=str(deep), device="cuda", dtype="bfloat16", show_progress=False)

    def step_ms(loaded) -> float:
        runner = ForwardRunner(loaded.model, num_blocks=8, block_size=4, profile=loaded.profile)
        batch = [SequenceBatchEntry([1], 1, [0])]
        for _ in range(3):
            runner.execute(batch)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            runner.execute(batch)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / 20 * 1e3

    resident = step_ms(load_model(ModelConfig(**kw)))
    loaded = load_model(ModelConfig(cpu_offload_gb=1.0, **kw))  # every layer
    offloaded = step_ms(loaded)
    copy_ms = loaded.offloader.host_bytes / 64e9 * 1e3
    print(
        f"decode step: resident {resident:.2f} ms, offloaded {offloaded:.2f} ms ({loaded.offloader.summary()})"
    )
    assert offloaded >= resident + 0.5 * copy_ms
