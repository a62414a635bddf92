"""A GGUF file with Q6_K tensors, as llama-quantize's Q4_K_M makes them (ffn_down, attn_v, the
tied token_embd), served under `auto`: Q6_K tensors are held in their own 6-bit blocks (q6), the
file's weights exactly, and the model's logits and greedy tokens are those of the same file
dequantized to float (`quantization none`, gguf's own dequantization) within the int16
activation rounding: layer by layer and in the fused decoder, on every kernel set this CPU runs."""

from __future__ import annotations

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from llmserve.config import ModelConfig
from llmserve.layers.quantization import QuantizedLinear, cpu_kernels
from llmserve.lora import LoRARequest
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.greedy import generate_greedy
from llmserve.model_executor.model_loader import load_model
from llmserve.model_executor.model_loader.gguf_loader import GGUFCheckpoint
from tests.gguf_writer import tiny_llama_config, tiny_llama_gguf
from tests.models.test_lora import ALL, make_adapter, make_runner, run_mixed
from tests.models.test_quantized import KERNEL_SETS, PROMPTS, TOL, _decode_logits

# Every matrix read exactly: q, k, v all Q6_K (a fused q6 layer of three shards), gate and up too,
# ffn_down, the embedding and the output (LM head) alone; o_proj Q4_0 beside them.
TYPES = {"attn_q": Q.Q6_K, "attn_k": Q.Q6_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_0, "ffn_gate": Q.Q6_K,
         "ffn_up": Q.Q6_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q6_K, "output": Q.Q6_K}  # fmt: skip


@pytest.fixture(scope="module")
def q6_gguf(tmp_path_factory):
    return tiny_llama_gguf(tmp_path_factory.mktemp("q6"), TYPES)


@pytest.fixture(scope="module")
def models(q6_gguf):
    quant = load_model(ModelConfig(model=str(q6_gguf), cpu_activations="int16", show_progress=False))
    plain = load_model(ModelConfig(model=str(q6_gguf), quantization="none", show_progress=False))
    return quant, plain


def test_q6_k_tensors_are_held_as_the_files_blocks(q6_gguf, models):
    quant, _ = models
    assert "Q6_K -> q6 (blocks kept)" in quant.summary()
    model = quant.model.model
    layer = model.layers[1]
    assert layer.self_attn.o_proj.fmt == "q4"
    assert layer.self_attn.qkv_proj.fmt == layer.mlp.gate_up_proj.fmt == layer.mlp.down_proj.fmt == "q6"
    assert model.embed_tokens.qweight.fmt == quant.model.lm_head.packed_weight.fmt == "q6"
    floats = dict((n, t) for n, t, _ in GGUFCheckpoint([q6_gguf]).iter_weights(torch.float32))
    down: QuantizedLinear = layer.mlp.down_proj
    assert torch.equal(down.logical_weight(), floats["model.layers.1.mlp.down_proj.weight"])
    gate_up = torch.cat([floats[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(layer.mlp.gate_up_proj.logical_weight(), gate_up)
    ids = torch.tensor([0, 7, 511, 256])
    assert torch.equal(model.embed_tokens(ids), floats["model.embed_tokens.weight"][ids])
    # 6.5625 bits a weight, as in the file: 210 bytes a super-block of 256
    assert down.qweight is not None and down.qweight.nbytes() == 256 * (512 // 256) * 210
    assert any(g.fmt == "q6" and g.role == "embedding" for g in quant.weight_groups)


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_logits_are_the_dequantized_files(models, kernels):
    quant, plain = models
    want = _decode_logits(plain.model, fused=False)
    assert want.abs().amax() > 0.1
    try:
        cpu_kernels.set_kernels(kernels)
        for fused in (True, False) if kernels != "torch" else (False,):
            got = _decode_logits(quant.model, fused)
            torch.testing.assert_close(got, want, rtol=TOL, atol=TOL, msg=f"{kernels}, fused={fused}")
    finally:
        cpu_kernels.set_kernels("auto")


def test_greedy_tokens_are_the_dequantized_files(models):
    """Greedy continuations (the fused decoder, the default) against the float model on the
    file's dequantized weights: the same tokens, or a first difference at a near-tie."""
    quant, plain = models
    ours = generate_greedy(ForwardRunner(quant.model, num_blocks=64, block_size=4), PROMPTS, 16)
    ref_runner = ForwardRunner(plain.model, num_blocks=64, block_size=4)
    theirs = generate_greedy(ref_runner, PROMPTS, 16)
    for prompt, a, b in zip(PROMPTS, ours, theirs, strict=True):
        if a == b:
            continue
        i = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        entry = [SequenceBatchEntry(prompt + b[:i], len(prompt) + i, list(range(16)))]
        logits = ForwardRunner(plain.model, num_blocks=16, block_size=4).execute(entry)[0]
        gap = float(logits[b[i]] - logits[a[i]])
        assert gap <= TOL, f"token {i}: ours {a[i]}, the float model's {b[i]}, {gap:.4f} apart"


def test_mixed_shards_keep_their_formats(tmp_path):
    """Q4_K_M's attn_v in Q6_K beside Q4_K q and k: the fused qkv layer keeps one matrix per
    format, q and k as q4k, v as q6 holding the file's values exactly; ffn_down alone is q6."""
    path = tiny_llama_gguf(tmp_path, {**TYPES, "attn_q": Q.Q4_K, "attn_k": Q.Q4_K})
    quant = load_model(ModelConfig(model=str(path), show_progress=False))
    layer = quant.model.model.layers[0]
    assert [p.fmt for p in layer.self_attn.qkv_proj.parts] == ["q4k", "q6"]
    assert layer.mlp.down_proj.fmt == "q6"
    floats = dict((n, t) for n, t, _ in GGUFCheckpoint([path]).iter_weights(torch.float32))
    v = floats["model.layers.0.self_attn.v_proj.weight"]
    qkv = layer.self_attn.qkv_proj.logical_weight()
    assert torch.equal(qkv[-v.shape[0] :], v)


def test_lora_on_a_q6_base(q6_gguf, tmp_path):
    """A PEFT adapter on every projection of a q6 base: the fused decoder and the layer path, with
    the adapter's sequences and a base one in one batch, against the float model of the same file
    with the same adapter."""
    transformers.LlamaForCausalLM(tiny_llama_config()).save_pretrained(tmp_path / "shapes")  # its shapes
    adapter = make_adapter(tmp_path / "shapes", tmp_path / "lora", ALL, seed=3)
    logits = {}
    for quantization, fused in (("auto", True), ("auto", False), ("none", False)):
        runner, manager = make_runner(q6_gguf, quantization)
        manager.add(LoRARequest("a", 1, str(adapter)))
        runner.use_fused(fused)
        logits[quantization, fused] = run_mixed(runner, [1, 0, 1])
    base = run_mixed(make_runner(q6_gguf, "none")[0], [0, 0, 0])
    assert (logits["none", False][0] - base[0]).abs().amax() > 50 * TOL  # the adapter moves them
    for key in (("auto", True), ("auto", False)):
        for got, want in zip(logits[key], logits["none", False], strict=True):
            torch.testing.assert_close(got, want, rtol=TOL, atol=TOL, msg=str(key))
