"""gpt-oss beyond the float / int8 / int4 parity tables (test_parity.py, test_quantized.py run the
tiny "gpt-oss" config): the offline engine with chunked prefill and prefix caching, OpenAI's
MXFP4 expert checkpoints, GGUF files as llama.cpp converts them (float, and MXFP4 experts kept in
their blocks), the triton backend's sinks, and the fused CPU decoder's refusal."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # the triton backend's kernels run under Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from llmserve import LLM, SamplingParams
from llmserve.config import ModelConfig
from llmserve.layers.quantization import QuantizedLinear, cpu_kernels
from llmserve.layers.quantization.fused_decoder import unsupported_reason
from llmserve.layers.quantization.mxfp4 import dequantize_mxfp4
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.model_loader import load_model
from llmserve.model_executor.model_loader.gguf_loader import GGUFCheckpoint
from tests.gguf_writer import hf_metadata, write_gguf, write_hf_model
from tests.models.test_quantized import TOL
from tests.models.tiny import TINY_CONFIGS, make_tiny_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT = [
    200,
    1,
    1,
    45,
    67,
    300,
    12,
    9,
    8,
    7,
    6,
    5,
    4,
    3,
    2,
    11,
    400,
    401,
    402,
    25,
]  # crosses the window of 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt-oss")
    return make_tiny_model("gpt-oss", folder), folder


def _logits(model, prompt: list[int]) -> torch.Tensor:
    runner = ForwardRunner(model, num_blocks=16, block_size=4)
    return runner.execute([SequenceBatchEntry(prompt, len(prompt), list(range(8)))], all_logits=True)


def test_offline_engine_matches_transformers_with_chunks_and_prefix_hits(tiny) -> None:
    """Greedy tokens equal transformers' generate: prompts prefilled in chunks of 8 tokens, the
    second run of each prompt from cached prefix blocks (sliding and full layers alike)."""
    hf, folder = tiny
    prompts = [PROMPT, [*PROMPT[:13], 77, 78, 79], [5, 17, 99, 3]]
    want = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None)
            want.append(out[0, len(p) :].tolist())
    llm = LLM(
        str(folder), show_progress=False, block_size=4, max_num_batched_tokens=8, enable_prefix_caching=True
    )
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for attempt in range(2):  # the second pass starts from the first one's cached blocks
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert [o.num_cached_tokens for o in outs] == ([0, 12, 0] if attempt == 0 else [16, 12, 0])


def test_plain_text_prompt(tiny) -> None:
    """A text prompt through the folder's tokenizer: transformers' greedy tokens, and their text."""
    hf, folder = tiny
    llm = LLM(str(folder), show_progress=False)
    ids = llm.get_tokenizer().encode("The quick brown fox")
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None)[
            0, len(ids) :
        ]
    [out] = llm.generate(
        ["The quick brown fox"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == want.tolist()
    assert out.outputs[0].text == llm.get_tokenizer().decode(want.tolist())


def test_fused_decoder_refuses_it(tiny) -> None:
    """int8 experts on the CPU would take the fused C++ decoder for Llama-family stacks; gpt-oss's
    sinks, expert biases and clamped SwiGLU are not in it: the layers run, and say why."""
    _, folder = tiny
    loaded = load_model(ModelConfig(model=str(folder), quantization="int8", show_progress=False))
    runner = ForwardRunner(loaded.model, num_blocks=8, block_size=4)
    runner.use_fused(True)
    assert runner.fused is None and runner.fused_unsupported == "no decoder spec"
    # the stack as a Llama-shaped spec would be refused for its MoE blocks too
    reason = unsupported_reason(loaded.model.model.decoder_spec(), runner.kv_caches)
    if cpu_kernels.has_native_kernels():
        assert reason is not None and reason.startswith("MoE routing the C++ decoder lacks")


def test_triton_backend_matches_transformers(tiny) -> None:
    """The sinks in the triton kernels (under the interpreter without CUDA): a prompt chunk that
    crosses the sliding window, then decode steps, against transformers."""
    hf, folder = tiny
    loaded = load_model(ModelConfig(model=str(folder), attention_backend="triton", show_progress=False))
    runner, blocks = ForwardRunner(loaded.model, num_blocks=16, block_size=4), list(range(8))
    pieces = [runner.execute([SequenceBatchEntry(PROMPT[:12], 12, blocks)], all_logits=True)]
    for pos in range(12, len(PROMPT)):
        pieces.append(runner.execute([SequenceBatchEntry([PROMPT[pos]], pos + 1, blocks)], all_logits=True))
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(torch.cat(pieces), ref.to(DEVICE), rtol=1e-4, atol=1e-4)


# -- MXFP4 -------------------------------------------------------------------------------------------


def test_mxfp4_dequantization_follows_the_spec() -> None:
    """A hand-built block: byte j holds element 2j (low nibble) and 2j + 1 (high); E2M1 codes
    0-7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8-15 their negatives; the block's E8M0 exponent e
    scales by 2^(e - 127)."""
    codes = list(range(16)) + list(range(16))
    blocks = torch.tensor([[codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(16)]], dtype=torch.uint8)
    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    for exponent in (127, 130, 120):
        got = dequantize_mxfp4(blocks, torch.tensor([exponent], dtype=torch.uint8))
        assert got.tolist() == [v * 2.0 ** (exponent - 127) for v in e2m1 + e2m1]


def test_mxfp4_dequantization_equals_transformers() -> None:
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (3, 10, 4), dtype=torch.uint8, generator=g)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2), want)
    # a loader that cast the codes to the model's float type keeps them
    assert torch.equal(dequantize_mxfp4(blocks.bfloat16(), scales.bfloat16()).transpose(1, 2), want)


def write_mxfp4_checkpoint(hf: torch.nn.Module, folder: Path, out: Path) -> None:
    """`folder`'s gpt-oss checkpoint in `out` with its experts as random MXFP4 `*_blocks` /
    `*_scales` and `quantization_config: mxfp4` (OpenAI's layout), its other files copied; `hf`
    (the model saved in `folder`) gets the dequantized experts, as a reference."""
    tensors = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, n_in, n_out = tensors.pop(name).shape
        blocks = torch.randint(0, 256, (E, n_out, n_in // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(122, 126, (E, n_out, n_in // 32), dtype=torch.uint8, generator=g)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        hf.get_parameter(name).data = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(tensors, out / "model.safetensors")
    for other in folder.iterdir():  # the tokenizer's files
        if other.is_file() and other.name not in ("model.safetensors", "config.json"):
            shutil.copy(other, out / other.name)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))


def test_mxfp4_checkpoint_as_openai_ships_it(tiny, tmp_path: Path) -> None:
    """Experts as `*_blocks` / `*_scales` with `quantization_config: mxfp4` (OpenAI's layout):
    dequantized at load, the logits are transformers' on the same dequantized weights."""
    hf = copy.deepcopy(tiny[0])  # its experts are replaced
    write_mxfp4_checkpoint(hf, tiny[1], tmp_path)
    loaded = load_model(ModelConfig(model=str(tmp_path), show_progress=False))
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(_logits(loaded.model, PROMPT), ref, rtol=1e-4, atol=1e-4)


# -- GGUF ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def f32_gguf(tiny, tmp_path_factory) -> Path:
    hf, folder = tiny
    path = tmp_path_factory.mktemp("gguf") / "f32.gguf"
    return write_hf_model(path, "gpt-oss", hf.config, load_file(folder / "model.safetensors"))[0]


def test_gguf_twin_matches_transformers(tiny, f32_gguf: Path) -> None:
    """llama.cpp's layout (gate and up apart, post_attention_norm, attn_sinks) read back: the
    same logits as transformers, and its config rebuilt from the metadata."""
    hf, _ = tiny
    loaded = load_model(ModelConfig(model=str(f32_gguf), show_progress=False))
    c = loaded.hf_config
    assert type(loaded.model).__name__ == "GptOssForCausalLM"
    assert (c.layer_types, c.sliding_window, c.num_local_experts) == (hf.config.layer_types, 8, 4)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(_logits(loaded.model, PROMPT), ref, rtol=1e-4, atol=1e-4)


def test_gguf_mxfp4_experts_stay_in_their_blocks(f32_gguf: Path, tmp_path: Path) -> None:
    """MXFP4 expert stacks (as llama.cpp ships gpt-oss) reach the experts as q8 rows holding the
    file's values exactly, and serve what the same file dequantized to float serves (within the
    int16 rounding of activations in the quantized matmuls)."""
    tensors = {}
    for t in GGUFReader(f32_gguf).tensors:
        arr = np.array(t.data).reshape(list(reversed(t.shape.tolist())))
        if "_exps.weight" in t.name:
            tensors[t.name] = (arr, Q.MXFP4)
        else:  # other matrices Q8_0 (auto would requantize F32 ones), the router and vectors F32
            tensors[t.name] = (arr, Q.Q8_0) if arr.ndim == 2 and "ffn_gate_inp" not in t.name else arr
    path = write_gguf(
        tmp_path / "mxfp4.gguf", "gpt-oss", tensors, hf_metadata("gpt-oss", TINY_CONFIGS["gpt-oss"]())
    )[0]
    quant = load_model(ModelConfig(model=str(path), cpu_activations="int16", show_progress=False))
    plain = load_model(ModelConfig(model=str(path), quantization="none", show_progress=False))
    layer = quant.model.model.layers[1].mlp.experts[3].gate_up_proj
    assert isinstance(layer, QuantizedLinear) and layer.fmt == "q8"
    floats = {n: t for n, t, _ in GGUFCheckpoint([path]).iter_weights(torch.float32)}
    prefix = "model.layers.1.mlp.experts.3."
    want = torch.cat([floats[prefix + "gate_proj.weight"], floats[prefix + "up_proj.weight"]])
    assert torch.equal(layer.logical_weight(), want)
    torch.testing.assert_close(_logits(quant.model, PROMPT), _logits(plain.model, PROMPT), rtol=TOL, atol=TOL)


def test_configs_without_the_swiglu_fields_take_openais_values(tiny) -> None:
    """transformers 5.17's GptOssConfig has neither `swiglu_alpha` nor `swiglu_limit` (the model
    failed to load under it): the experts' gating then uses alpha 1.702 and limit 7.0."""
    from types import SimpleNamespace

    from llmserve.layers.activation import clamped_swiglu
    from llmserve.models.gpt_oss import GptOssForCausalLM

    hf, _ = tiny
    fields = {k: getattr(hf.config, k) for k in ("hidden_size", "num_local_experts", "num_experts_per_tok",
                                                  "intermediate_size")}  # fmt: skip
    glu = GptOssForCausalLM.build_mlp(SimpleNamespace(**fields), 0).experts[0].glu
    gate, up = torch.linspace(-10, 10, 41), torch.linspace(9, -9, 41)
    assert torch.equal(glu(gate, up), clamped_swiglu(1.702, 7.0)(gate, up))
    assert not torch.equal(glu(gate, up), clamped_swiglu(1.0, 7.0)(gate, up))
