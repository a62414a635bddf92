"""The CUDA-graph runner's padding and persistent buffers, run on the CPU by eager replay.

`GraphRunner(capture=False)` pads a decode batch to its capture size and runs the fixed-shape
step through the same code a graph replay uses (the same buffers, the pad block, the fixed block
table width), only eagerly: the real rows must be what an unpadded step gives, the padding must
never touch a sequence's blocks, and the step's tensors must keep their addresses from step to
step (what a captured graph reads). The Triton backend (under the interpreter) runs the same
padded steps through a whole model, RoPE fused into its cache write.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from llmserve.config import ModelConfig
from llmserve.engine.llm import LLM
from llmserve.layers.attention import KVDtypes
from llmserve.model_executor.cuda_graph import capture_sizes, collection_paused
from llmserve.model_executor.device import build_profile
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.gpu_memory import kv_cache_budget
from llmserve.model_executor.model_loader import load_model
from llmserve.sampling_params import SamplingParams
from tests.models.tiny import make_tiny_model

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [21, 22, 23, 24, 25, 26, 27, 28, 29], [3], [40, 41, 42]]


def test_capture_sizes_follow_vllm_and_hold_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 8]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(10_000)[-1] == 512 and len(capture_sizes(10_000)) == 67


class Cycle:
    """An object only a reference cycle keeps: freed by the collector alone (as a dropped engine
    and its CUDA graphs are)."""

    def __init__(self, freed: list[str], name: str) -> None:
        self.me, self.freed, self.name = self, freed, name

    def __del__(self) -> None:
        self.freed.append(self.name)


@pytest.mark.parametrize("enabled", [True, False])
def test_captures_run_after_a_collection_and_with_none_during_them(enabled: bool) -> None:
    """`collection_paused`, what `GraphRunner.capture` runs in: the dead cycles are freed on entry
    (a dropped engine's graphs are destroyed before a capture, not in the middle of one); then no
    automatic collection, so garbage made during a capture waits; the collector's setting is
    restored, also after an error."""
    freed: list[str] = []
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        Cycle(freed, "before")
        with collection_paused():
            assert freed == ["before"] and not gc.isenabled()
            Cycle(freed, "during")
            kept = [[] for _ in range(20_000)]  # far past gen 0's threshold: a collection, if enabled
            assert freed == ["before"] and len(kept) == 20_000
        assert gc.isenabled() is enabled
        with pytest.raises(KeyError), collection_paused():
            raise KeyError("a failed capture")
        assert gc.isenabled() is enabled and freed == ["before", "during"]
    finally:
        (gc.enable if was else gc.disable)()
        gc.collect()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-graphs")
    make_tiny_model("llama", folder)
    return str(folder)


def decode_steps(runner: ForwardRunner, num_seqs: int, steps: int = 3) -> torch.Tensor:
    """Prefill the first `num_seqs` prompts, then decode `steps` tokens each; logits [steps, S, V]."""
    prompts = [list(p) for p in PROMPTS[:num_seqs]]
    tables = [[10 + 4 * i + j for j in range(4)] for i in range(num_seqs)]  # 16 tokens each
    runner.execute([SequenceBatchEntry(p, len(p), t) for p, t in zip(prompts, tables, strict=True)])
    out = []
    for step in range(steps):
        for i, p in enumerate(prompts):
            p.append((7 * step + i) % 500)
        batch = [SequenceBatchEntry([p[-1]], len(p), t) for p, t in zip(prompts, tables, strict=True)]
        out.append(runner.execute(batch))
    return torch.stack(out)


@pytest.mark.parametrize("num_seqs", [1, 3, 5])
def test_padded_steps_give_the_unpadded_logits_and_leave_other_blocks_alone(tiny: str, num_seqs: int) -> None:
    loaded = load_model(ModelConfig(model=tiny, show_progress=False))
    plain = ForwardRunner(loaded.model, num_blocks=40, block_size=4, max_model_len=64)
    padded = ForwardRunner(loaded.model, num_blocks=40, block_size=4, max_model_len=64)
    graphs = padded.use_graphs(max_num_seqs=8, max_model_len=64, capture=False)
    assert graphs.width == 16 and graphs.padded_size(num_seqs) == {1: 1, 3: 4, 5: 8}[num_seqs]
    want, got = decode_steps(plain, num_seqs), decode_steps(padded, num_seqs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(plain.kv_caches, padded.kv_caches, strict=True):
        torch.testing.assert_close(b[:, :, :40], a[:, :, :40], rtol=0, atol=0)  # the blocks sequences own
        if num_seqs in (3, 5):  # padding rows wrote their K/V, into the pad block only
            assert b[:, :, 40].abs().sum() > 0 and a[:, :, 40].abs().sum() == 0


def test_step_tensors_keep_their_addresses(tiny: str) -> None:
    """A captured graph reads the buffers it was captured on: every padded step of a size writes
    its inputs into the same memory, with the same shapes."""
    loaded = load_model(ModelConfig(model=tiny, show_progress=False))
    runner = ForwardRunner(loaded.model, num_blocks=40, block_size=4, max_model_len=64)
    graphs = runner.use_graphs(max_num_seqs=8, max_model_len=64, capture=False)
    generation = runner.buffers.generation
    seen = []
    for batch in (
        [SequenceBatchEntry([1], 3, [0])],
        [SequenceBatchEntry([2], 9, [1, 2, 3]), SequenceBatchEntry([3], 1, [4])],
    ):
        inputs = runner.prepare(graphs.pad(batch, 4), width=graphs.width)
        md = inputs.metadata
        tensors = (inputs.input_ids, inputs.positions, md.slot_mapping, md.block_tables, md.seq_lens_tensor)
        seen.append([(t.data_ptr(), tuple(t.shape)) for t in tensors])
        assert md.block_tables.shape == (4, 16) and md.max_query_len == 1
        assert md.block_tables[len(batch) :].eq(runner.pad_block).all()
    assert seen[0] == seen[1] and runner.buffers.generation == generation


def test_batches_graphs_do_not_take_run_eagerly(tiny: str) -> None:
    loaded = load_model(ModelConfig(model=tiny, show_progress=False))
    runner = ForwardRunner(loaded.model, num_blocks=40, block_size=4, max_model_len=64)
    graphs = runner.use_graphs(max_num_seqs=2, max_model_len=64, capture=False)
    prefill = [SequenceBatchEntry([1, 2, 3], 3, [0])]
    decodes = [SequenceBatchEntry([1], 2, [i]) for i in range(3)]  # more than the largest size
    assert not graphs.applies(prefill) and not graphs.applies(decodes)
    assert graphs.applies(decodes[:2])
    assert runner.execute(decodes).shape == (3, 512)


def test_engine_greedy_output_is_unchanged_by_graph_padding(tiny: str) -> None:
    """The whole engine (scheduler, sampler) over padded decode steps: the same greedy tokens."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    kwargs = dict(num_kv_blocks=64, max_num_seqs=8, show_progress=False)
    want = [o.outputs[0].token_ids for o in LLM(tiny, **kwargs).generate(prompts, params, use_tqdm=False)]
    llm = LLM(tiny, **kwargs)
    llm.engine.runner.runner.use_graphs(8, llm.engine.max_model_len, capture=False)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_triton_model_steps_match_the_reference_backend(tiny: str) -> None:
    """A whole model on the Triton backend (q and k rotated inside its cache write), padded decode
    steps included, against the torch reference backend."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(model=tiny, device=device, dtype="float32", show_progress=False)  # CUDA's default is bf16
    ref = load_model(ModelConfig(**kw, attention_backend="torch"))
    tri = load_model(ModelConfig(**kw, attention_backend="triton"))
    assert (
        tri.profile.attention_backend == "triton" and tri.model.model.layers[0].self_attn.attn.rope_in_backend
    )
    want = decode_steps(ForwardRunner(ref.model, num_blocks=40, block_size=4, max_model_len=64), 3)
    runner = ForwardRunner(tri.model, num_blocks=40, block_size=4, max_model_len=64, profile=tri.profile)
    runner.use_graphs(max_num_seqs=4, max_model_len=64, capture=False)
    got = decode_steps(runner, 3)
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-4, atol=1e-4)


def test_kv_cache_budget_is_what_utilization_leaves() -> None:
    GiB = 2**30
    assert kv_cache_budget(80 * GiB, 3 * GiB, 1 * GiB, 0.9) == int(0.9 * 80 * GiB) - 4 * GiB
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.05 allows 4.00 GiB"):
        kv_cache_budget(80 * GiB, 3 * GiB, 2 * GiB, 0.05)


def test_profile_decisions_by_device() -> None:
    cpu = build_profile(torch.device("cpu"))
    assert cpu.is_cpu and cpu.fused_cpu_decoder and not cpu.cuda_graphs and cpu.keep_freed_memory
    assert cpu.huge_page_weights
    assert cpu.model_dtype("auto", None) == torch.float32
    assert cpu.kv_cache_dtype("auto", torch.float32, quantized=True) == KVDtypes.of(torch.float16)
    assert cpu.kv_cache_dtype("auto", torch.float32, quantized=False) == KVDtypes.of(torch.float32)
    assert cpu.kv_cache_dtype("int8", torch.float32) == KVDtypes.of(torch.int8)
    assert cpu.kv_cache_dtype("q8_0,f16", torch.float32) == KVDtypes(torch.int8, torch.float16)


def test_triton_backend_off_cuda_is_refused(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend 'triton' runs on CUDA devices"):
        build_profile(torch.device("cpu"), "triton")
