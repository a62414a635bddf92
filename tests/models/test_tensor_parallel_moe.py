"""Tensor parallelism of mixture-of-experts models (TP=2, one thread per rank) against the same
engine at TP=1: Mixtral, Qwen2-MoE (a shared expert, a dense layer), Qwen3-MoE and gpt-oss
(stacked and MXFP4 experts, biases, sinks); float on the layer path, q8 on the fused C++ decoder
(the MoE block's shares summed over the shared-memory group inside the call) and on the layer
path over gloo, llama.cpp's expert blocks; the refusal of a width the size does not divide."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from llmserve.engine.llm import build_engine
from tests.models.test_gpt_oss import write_mxfp4_checkpoint
from tests.models.test_moe import moe_gguf
from tests.models.test_tensor_parallel import PROMPTS, _run, compare_tp
from tests.models.tiny import _LLAMA_LIKE, make_tiny_model, save_tiny_tokenizer


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe", "qwen3-moe"])
def test_tp2_matches_tp1_moe_float(name, tmp_path):
    """Every expert's gate_up and down split on its intermediate dimension (the shared expert's
    and the dense layer's too), the router replicated: TP=1's greedy tokens."""
    make_tiny_model(name, tmp_path)
    compare_tp(str(tmp_path))


def _quantizable(name: str) -> transformers.PretrainedConfig:
    """MoE configs whose expert widths split into whole q8 blocks of 32 columns per rank (the
    tiny parity configs' Qwen experts are 48 and 32 wide)."""
    if name == "mixtral":  # experts 128 wide
        return transformers.MixtralConfig(**_LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2)
    if name == "qwen2-moe":  # a shared expert; layer 1 dense
        return transformers.Qwen2MoeConfig(
            **_LLAMA_LIKE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=128, mlp_only_layers=[1], norm_topk_prob=False,
        )  # fmt: skip
    return transformers.Qwen3MoeConfig(
        **_LLAMA_LIKE, head_dim=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=64,
        norm_topk_prob=True,
    )  # fmt: skip


def _save(config: transformers.PretrainedConfig, folder: Path) -> str:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    save_tiny_tokenizer(folder, config.vocab_size)
    return str(folder)


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe", "qwen3-moe"])
def test_tp2_moe_int8_fused_and_layers_match_tp1(name, tmp_path, monkeypatch):
    """q8 experts quantized as each rank loads its slices: each rank's fused decoder (the MoE
    block's output summed over the shared-memory group inside the C++ call) and the layer path
    over gloo give TP=1's greedy tokens (itself fused), with prefix caching, chunked prefill and
    preemption at work; logprobs within the per-shard activation rounding (test_tensor_parallel)."""
    model = _save(_quantizable(name), tmp_path)
    tp = dict(tensor_parallel_size=2, threads_per_rank=1, quantization="int8")
    ref_tokens, ref_lp, ref_preempt = _run(model, fused=True, quantization="int8")
    tp_tokens, tp_lp, tp_preempt = _run(model, fused=True, **tp)
    monkeypatch.setenv("LLMSERVE_TP_TRANSPORT", "gloo")
    gloo_tokens, gloo_lp, _ = _run(model, fused=False, **tp)
    assert ref_preempt > 0 and tp_preempt == ref_preempt
    assert tp_tokens == ref_tokens == gloo_tokens
    np.testing.assert_allclose(np.array(tp_lp), np.array(ref_lp), rtol=0, atol=2e-3)
    np.testing.assert_allclose(np.array(gloo_lp), np.array(ref_lp), rtol=0, atol=2e-3)


@pytest.mark.parametrize(("label", "expert_type"), [("qwen3moe", Q.Q4_K), ("mixtral", Q.Q8_0)])
def test_tp2_moe_gguf_blocks_fused_match_tp1(label, expert_type, tmp_path):
    """A llama.cpp MoE file's stacked experts, kept in their q4 / q8 blocks, cut along whole
    blocks (256-wide experts: 128 columns a rank): each rank's fused decoder gives TP=1's tokens
    (itself fused); the vocabulary is 256, so the prompts' ids are taken modulo it."""
    model = str(moe_gguf(tmp_path, label, expert_type, tokenizer=True))
    prompts = [[t % 256 for t in p] for p in PROMPTS]
    ref_tokens, ref_lp, ref_preempt = _run(model, fused=True, prompts=prompts)
    tp_tokens, tp_lp, tp_preempt = _run(
        model, fused=True, prompts=prompts, tensor_parallel_size=2, threads_per_rank=1
    )
    assert ref_preempt > 0 and tp_preempt == ref_preempt
    assert tp_tokens == ref_tokens
    np.testing.assert_allclose(np.array(tp_lp), np.array(ref_lp), rtol=0, atol=2e-3)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_tp2_gpt_oss_matches_tp1(quantization, tmp_path):
    """gpt-oss: its stacked, interleaved expert tensors cut before they are split per expert,
    the experts' gate_up bias split with them and their down bias added once, the sinks split
    by head, the attention biases as Qwen2's; float, and q8 experts quantized as each rank loads
    its slices (the layer path either way: the fused decoder has no sinks or clamped SwiGLU).
    transformers initialises the biases to zero: they are drawn at random here, so they count."""
    hf = make_tiny_model("gpt-oss", tmp_path)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") and ".router." not in name:
                p.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path)
    compare_tp(str(tmp_path), atol=1e-4 if quantization == "none" else 2e-3, quantization=quantization)


def test_tp2_gpt_oss_mxfp4_matches_tp1(tmp_path):
    """OpenAI's MXFP4 experts (`*_blocks` / `*_scales`): gate_up's rows and down's input blocks
    cut before they are dequantized (whole blocks of 32: 64 of down's 128 columns a rank)."""
    hf = make_tiny_model("gpt-oss", tmp_path / "float")
    (tmp_path / "mxfp4").mkdir()
    write_mxfp4_checkpoint(hf, tmp_path / "float", tmp_path / "mxfp4")
    compare_tp(str(tmp_path / "mxfp4"))


def test_moe_refusals(tmp_path):
    """An expert width the size does not divide: ValueError naming it, before any worker
    starts. (q8 experts quantized at load take any width: each rank quantizes its own slice; a
    GGUF's blocks are refused as test_tensor_parallel's dense layers are.)"""
    config = _quantizable("qwen3-moe")
    config.moe_intermediate_size = 33
    odd = _save(config, tmp_path / "odd")
    with pytest.raises(ValueError, match=r"does not divide the model's moe_intermediate_size \(33\)"):
        build_engine(odd, show_progress=False, tensor_parallel_size=2)
