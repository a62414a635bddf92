"""GGUFCheckpoint: tiny HF models converted the way llama.cpp converts them come back as the exact
HF tensors and an equivalent config; every supported tensor type dequantizes right; split GGUFs;
the errors a user can meet; and the real embedded GGUFs."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from llmserve.layers.rotary_embedding import rope_parameters
from llmserve.model_executor.model_loader.errors import (
    ModelLoadError,
    ModelNotFoundError,
    UnexpectedWeightError,
    UnsupportedArchitectureError,
    UnsupportedTensorTypeError,
)
from llmserve.model_executor.model_loader.gguf_loader import GGUFCheckpoint, _FastReader
from llmserve.model_executor.model_loader.source import BUNDLED_MODELS, DEFAULT_MODEL
from tests.gguf_writer import REFERENCE_DEQUANT, write_gguf, write_hf_model
from tests.models.tiny import reference_attention

_DECODER = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, bos_token_id=1, eos_token_id=2
)
TINY: dict[str, Callable[[], Any]] = {
    # GQA, untied head, llama.cpp's Q/K permutation
    "llama": lambda: transformers.LlamaConfig(
        **_DECODER, num_hidden_layers=2, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=5e5,
        max_position_embeddings=128, tie_word_embeddings=False,
    ),
    "qwen2": lambda: transformers.Qwen2Config(**_DECODER, num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=True),
    # head_dim 16 != hidden / heads, as in real Qwen3
    "qwen3": lambda: transformers.Qwen3Config(
        **_DECODER, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False
    ),
    # 7 layers: layer 5 is the first global one; a prompt longer than the window exercises both kinds
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **_DECODER, num_hidden_layers=7, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=8, max_position_embeddings=128,
    ),
    # fused qkv and gate_up; 3/4 of each head rotated (Phi-4-mini); a window on every layer
    "phi3": lambda: transformers.Phi3Config(
        **_DECODER, num_hidden_layers=2, num_key_value_heads=2, partial_rotary_factor=0.75,
        sliding_window=8, max_position_embeddings=128, original_max_position_embeddings=128,
        tie_word_embeddings=False, pad_token_id=None,
    ),
    # LongRoPE (Phi-3-mini-128k, Phi-3.5-mini): factor sets as tensors, no window, tied embeddings
    "phi3-longrope": lambda: transformers.Phi3Config(
        **_DECODER, num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=128,
        original_max_position_embeddings=32, tie_word_embeddings=True, pad_token_id=None,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.25, 1.5, 2.0],
            "long_factor": [1.5, 3.0, 6.0, 12.0],
        },
    ),
    # Llama's layout and Q/K permutation; every fourth layer without RoPE (llama.cpp: always 4)
    "smollm3": lambda: transformers.SmolLM3Config(
        **_DECODER, num_hidden_layers=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True, pad_token_id=None,
    ),
    # Llama's layout and Q/K permutation, and the four multipliers
    "granite": lambda: transformers.GraniteConfig(
        **_DECODER, num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=128,
        embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.25,
        logits_scaling=8.0, tie_word_embeddings=True, pad_token_id=None,
    ),
    # norms after the sublayers; q and k normalised over all heads; nothing permuted
    "olmo2": lambda: transformers.Olmo2Config(
        **_DECODER, num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, pad_token_id=None,
    ),
    # sliding and full layers alternating, soft-capped attention scores and logits, no q/k norms
    "gemma2": lambda: transformers.Gemma2Config(
        **_DECODER, num_hidden_layers=3, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=8, max_position_embeddings=128, attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
    ),
    # LayerNorms with biases, biases everywhere, a plain MLP (no window: llama.cpp writes none)
    "starcoder2": lambda: transformers.Starcoder2Config(
        **_DECODER, num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=128,
        sliding_window=None, tie_word_embeddings=True, pad_token_id=None,
    ),
    # post-norm layers, per-head q/k norms, a sliding layer then a global one without RoPE
    "exaone4": lambda: transformers.Exaone4Config(
        **_DECODER, num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=128,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
        pad_token_id=None,
    ),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2
    ),
    # mixture-of-experts: stacked *_exps tensors split per expert; Mixtral is llama.cpp's `llama`
    "mixtral": lambda: transformers.MixtralConfig(
        **_DECODER, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
    "qwen2moe": lambda: transformers.Qwen2MoeConfig(
        **_DECODER, num_hidden_layers=2, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=32, norm_topk_prob=False,
    ),
    "qwen3moe": lambda: transformers.Qwen3MoeConfig(
        **_DECODER, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True, tie_word_embeddings=False,
    ),
}  # fmt: skip
GGUF_ARCH = {"mixtral": "llama", "phi3-longrope": "phi3"}
"""Test labels whose llama.cpp architecture name differs."""
CONFIG_KEYS = (
    "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "rope_parameters", "bos_token_id", "eos_token_id", "layer_types",
    "sliding_window", "query_pre_attn_scalar", "hidden_activation", "n_embd", "n_layer", "n_head",
    "n_positions", "layer_norm_epsilon", "num_local_experts", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
    "mlp_only_layers", "partial_rotary_factor", "original_max_position_embeddings", "no_rope_layers",
    "embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling",
    "attn_logit_softcapping", "final_logit_softcapping", "norm_epsilon", "use_bias",
)  # fmt: skip


@pytest.fixture(scope="module", params=list(TINY))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A random tiny HF model, its safetensors checkpoint, and its llama.cpp-style GGUF."""
    arch, tmp = request.param, tmp_path_factory.mktemp(request.param)
    config = TINY[arch]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, **reference_attention(config)).eval()
    config.architectures = [type(model).__name__]
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5)  # norms too: the +1 / transpose / permutation must all be undone
            if name.endswith("norm.weight"):
                p.copy_(torch.round(p * 1024) / 1024)  # so that llama.cpp's (w + 1) is exact in float32
    model.save_pretrained(tmp / "hf")
    ref = load_file(tmp / "hf" / "model.safetensors")
    paths = write_hf_model(tmp / "model.gguf", GGUF_ARCH.get(arch, arch), config, ref)
    return {"arch": arch, "config": config, "model": model, "ref": ref, "paths": paths}


def test_weights_equal_hf_checkpoint(tiny: dict[str, Any]) -> None:
    ckpt = GGUFCheckpoint(tiny["paths"])
    got = {name: tensor for name, tensor, _ in ckpt.iter_weights(torch.float32)}
    assert sorted(got) == sorted(tiny["ref"])
    assert ckpt.num_tensors() == len(got)
    for name, expected in tiny["ref"].items():
        assert got[name].dtype == torch.float32 and got[name].shape == expected.shape, name
        assert torch.equal(got[name], expected), name


def test_config_matches_hf_config(tiny: dict[str, Any]) -> None:
    ours, orig = GGUFCheckpoint(tiny["paths"]).hf_config(), tiny["config"]
    assert type(ours) is type(orig)
    for key in CONFIG_KEYS:
        if hasattr(orig, key):
            want = getattr(orig, key)
            if key == "head_dim" and want is None:  # Mixtral's config leaves it implied
                want = orig.hidden_size // orig.num_attention_heads
            assert getattr(ours, key) == want, key


def test_hf_model_from_gguf_gives_same_logits(tiny: dict[str, Any], tmp_path: Path) -> None:
    """The config is complete: transformers builds the same function from it and the weights
    (saved as a checkpoint, so that transformers maps per-expert tensors onto its stacked ones)."""
    ckpt = GGUFCheckpoint(tiny["paths"])
    ckpt.hf_config().save_pretrained(tmp_path)
    save_file(
        {n: t.contiguous() for n, t, _ in ckpt.iter_weights(torch.float32)}, tmp_path / "model.safetensors"
    )
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True, **reference_attention(tiny["config"])
    )
    assert not info["unexpected_keys"] and set(info["missing_keys"]) <= (
        {"lm_head.weight"} if tiny["config"].tie_word_embeddings else set()
    )
    model.eval()
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, tiny["model"](ids).logits, rtol=1e-5, atol=1e-5)


# -- tensor types ---------------------------------------------------------------------------------

# Worst error per 32-value block as (fraction of max |x|, fraction of max - min), f16 scales included.
QUANT_BOUND = {
    Q.Q8_0: (0.5 / 127 + 1e-3, 0), Q.Q4_0: (1 / 8 + 1e-3, 0), Q.Q5_0: (1 / 16 + 1e-3, 0),
    Q.Q4_1: (3e-3, 1 / 30), Q.Q5_1: (3e-3, 1 / 62),
}  # fmt: skip


def _load_one(path: Path, tensor: Any) -> torch.Tensor:
    """Write `tensor` as llama's token_embd (no conversion fix applies) and read it back."""
    ckpt = GGUFCheckpoint(write_gguf(path, "llama", {"token_embd.weight": tensor}))
    [(name, out, _)] = ckpt.iter_weights(torch.float32)
    assert name == "model.embed_tokens.weight"
    return out


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, *QUANT_BOUND], ids=lambda q: q.name)
def test_quantized_within_expected_error(tmp_path: Path, qtype: Q) -> None:
    x = np.random.default_rng(0).normal(size=(8, 256)).astype(np.float32)
    got = _load_one(tmp_path / "q.gguf", (x, qtype))
    assert got.shape == (8, 256) and got.dtype == torch.float32
    err = np.abs(got.numpy() - x)
    if qtype in QUANT_BOUND:
        blocks, (k_abs, k_range) = x.reshape(8, 8, 32), QUANT_BOUND[qtype]
        bound = k_abs * np.abs(blocks).max(-1, keepdims=True) + k_range * np.ptp(blocks, -1, keepdims=True)
        assert (err.reshape(8, 8, 32) <= bound).all()
    else:
        assert (err <= np.abs(x) * (2**-8 if qtype == Q.BF16 else 2**-11)).all()


@pytest.mark.parametrize("qtype", list(REFERENCE_DEQUANT), ids=lambda q: q.name)
def test_raw_blocks_match_hand_dequantization(tmp_path: Path, qtype: Q) -> None:
    """Random valid blocks (finite f16 scales), checked against ggml's reference formulas."""
    ref, scale_offsets = REFERENCE_DEQUANT[qtype]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 2, 512
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    for o in scale_offsets:
        raw[:, o : o + 2] = rng.uniform(0.01, 0.1, size=(len(raw), 1)).astype(np.float16).view(np.uint8)
    ckpt = GGUFCheckpoint(
        write_gguf(tmp_path / "raw.gguf", "llama", {"token_embd.weight": (raw.reshape(rows, -1), qtype)})
    )
    [(_, got, _)] = ckpt.iter_weights(torch.float32)
    expected = torch.tensor([v for block in raw for v in ref(block.tobytes())]).reshape(rows, cols)
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-5)
    [(_, got16, _)] = ckpt.iter_weights(torch.bfloat16)  # converted after dequantizing to float32
    assert got16.dtype == torch.bfloat16 and torch.equal(got16, got.to(torch.bfloat16))


# -- split files ----------------------------------------------------------------------------------


def _tiny_llama(tmp: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    config = TINY["llama"]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return config, {n: t.detach().clone() for n, t in model.state_dict().items()}


def test_split_gguf_yields_every_tensor(tmp_path: Path) -> None:
    config, ref = _tiny_llama(tmp_path)
    paths = write_hf_model(tmp_path / "x.gguf", "llama", config, ref, num_parts=3)
    assert [p.name for p in paths] == [f"x-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert "llama.block_count" not in gguf.GGUFReader(paths[2]).fields  # like gguf-split
    ckpt = GGUFCheckpoint(paths)
    assert ckpt.hf_config().num_hidden_layers == 2
    got = {name: (tensor, file) for name, tensor, file in ckpt.iter_weights(torch.float32)}
    assert sorted(got) == sorted(ref) and all(torch.equal(got[n][0], ref[n]) for n in ref)
    assert {file for _, file in got.values()} == {str(p) for p in paths}


def test_split_gguf_must_be_whole_and_in_order(tmp_path: Path) -> None:
    config, ref = _tiny_llama(tmp_path)
    paths = write_hf_model(tmp_path / "x.gguf", "llama", config, ref, num_parts=3)
    with pytest.raises(ModelLoadError, match=r"x-00001-of-00003\.gguf: split GGUF has 3 parts, 2 given"):
        GGUFCheckpoint(paths[:2])
    with pytest.raises(ModelLoadError, match=r"x-00003-of-00003\.gguf: is split part 3, given as 2"):
        GGUFCheckpoint([paths[0], paths[2], paths[1]])


# -- metadata -------------------------------------------------------------------------------------


def test_fast_reader_builds_the_same_fields_as_gguf_reader(tmp_path: Path) -> None:
    def metadata(w: gguf.GGUFWriter) -> None:
        w.add_token_list(["a", "", "héllo", "<s>"])
        w.add_token_scores([0.5, -1.0, 2.0, 0.0])
        w.add_token_types([1, 2, 3, 1])
        w.add_array("test.flags", [True, False])
        w.add_array("test.empty", [])
        w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)

    [path] = write_gguf(
        tmp_path / "m.gguf", "llama", {"token_embd.weight": np.ones((4, 32), np.float32)}, metadata
    )
    stock, fast = gguf.GGUFReader(path), _FastReader(path)
    assert list(stock.fields) == list(fast.fields)
    for key, a in stock.fields.items():
        b = fast.fields[key]
        assert (a.offset, a.data, a.types, len(a.parts)) == (b.offset, b.data, b.types, len(b.parts)), key
        assert all(
            x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a.parts, b.parts, strict=True)
        ), key
    assert [t.data_offset for t in stock.tensors] == [t.data_offset for t in fast.tensors]
    ckpt = GGUFCheckpoint([path])
    assert ckpt.field("tokenizer.ggml.tokens") == ["a", "", "héllo", "<s>"]
    assert ckpt.arch_field("attention.layer_norm_rms_epsilon") == 1e-5  # not 9.99999974e-06
    assert ckpt.field("test.missing", 7) == 7 and ckpt.vocab_size() == 4


def test_llama3_rope_freqs_become_rope_parameters(tmp_path: Path) -> None:
    """llama.cpp stores Llama 3.1's RoPE scaling only as a `rope_freqs` tensor of divisors."""
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    config = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, rope_parameters=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / 5e5 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    tensors = {
        "token_embd.weight": np.zeros((4, 128), np.float32),
        "rope_freqs.weight": (plain / scaled).numpy(),
    }

    def metadata(w: gguf.GGUFWriter) -> None:
        for key, value in [("block_count", 1), ("embedding_length", 128), ("attention.head_count", 2),
                           ("feed_forward_length", 256), ("context_length", 131072)]:  # fmt: skip
            w.add_uint32(f"llama.{key}", value)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_rope_freq_base(5e5)

    ckpt = GGUFCheckpoint(write_gguf(tmp_path / "l3.gguf", "llama", tensors, metadata))
    ours = ckpt.hf_config()
    assert rope_parameters(ours) == rope
    torch.testing.assert_close(ROPE_INIT_FUNCTIONS["llama3"](ours, "cpu")[0], scaled)
    names = [name for name, _, _ in ckpt.iter_weights(torch.float32)]
    assert ckpt.num_tensors() == 1 and names == ["model.embed_tokens.weight"]  # rope_freqs is no HF tensor


def test_gemma3_27b_rules_and_rope_scaling(tmp_path: Path) -> None:
    """What llama.cpp hard-codes for Gemma 3 27B (62 layers): queries scaled by hidden / heads; the
    linear RoPE scaling applies to global layers only (HF's gemma-3-27b config)."""

    def metadata(w: gguf.GGUFWriter) -> None:
        for key, value in [("block_count", 62), ("embedding_length", 5376), ("attention.head_count", 32),
                           ("attention.head_count_kv", 16), ("attention.key_length", 128), ("vocab_size", 262208),
                           ("context_length", 131072), ("feed_forward_length", 21504),
                           ("attention.sliding_window", 1024)]:  # fmt: skip
            w.add_uint32(f"gemma3.{key}", value)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_freq_base(1e6)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(8.0)

    config = GGUFCheckpoint(write_gguf(tmp_path / "g.gguf", "gemma3", {}, metadata)).hf_config()
    assert config.query_pre_attn_scalar == 168 and config.head_dim == 128 and config.sliding_window == 1024
    linear = {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    assert rope_parameters(config, "full_attention") == linear
    assert rope_parameters(config, "sliding_attention") == {"rope_type": "default", "rope_theta": 10000.0}
    assert [i for i, t in enumerate(config.layer_types) if t == "full_attention"] == list(range(5, 62, 6))


# -- errors ---------------------------------------------------------------------------------------


def test_unsupported_architecture(tmp_path: Path) -> None:
    [path] = write_gguf(
        tmp_path / "mamba.gguf", "mamba", {"token_embd.weight": np.zeros((4, 32), np.float32)}
    )
    ckpt = GGUFCheckpoint([path])
    assert ckpt.architecture == "mamba"
    for call in (ckpt.hf_config, lambda: ckpt.iter_weights(torch.float32)):
        with pytest.raises(
            UnsupportedArchitectureError,
            match=rf"{path}.*'mamba'.*exaone4, gemma-embedding, gemma2, gemma3, gpt-oss, gpt2, granite, granitemoe, llama, modern-bert, nomic-bert, olmo2, phi3, qwen2, qwen2moe, qwen2vl, qwen3, qwen3moe, smollm3, starcoder2",
        ):
            call()


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.TQ1_0], ids=lambda q: q.name)
def test_unsupported_tensor_type_raises_before_yielding(tmp_path: Path, qtype: Q) -> None:
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    tensors = {
        "token_embd.weight": np.zeros((4, 256), np.float32),  # a good tensor first: nothing may be yielded
        "output.weight": (np.zeros((4, type_size), np.uint8), qtype),
    }
    [path] = write_gguf(tmp_path / "q.gguf", "llama", tensors)
    with pytest.raises(
        UnsupportedTensorTypeError, match=rf"{path}: tensor 'output.weight' has type {qtype.name}.*Q6_K"
    ):
        GGUFCheckpoint([path]).iter_weights(torch.float32)  # raises at the call, not at the first next()


def test_unknown_tensor_name(tmp_path: Path) -> None:
    [path] = write_gguf(tmp_path / "u.gguf", "qwen2", {"blk.0.mystery.weight": np.zeros((4, 32), np.float32)})
    with pytest.raises(UnexpectedWeightError, match=rf"{path}: GGUF tensor 'blk.0.mystery.weight'"):
        GGUFCheckpoint([path]).iter_weights(torch.float32)


def test_not_a_gguf(tmp_path: Path) -> None:
    [good] = write_gguf(tmp_path / "good.gguf", "llama", {"token_embd.weight": np.zeros((4, 32), np.float32)})
    cases = {
        "text.gguf": b"this is not a gguf file at all" * 4,
        "empty.gguf": b"",
        "cut.gguf": good.read_bytes()[:40],
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ModelLoadError, match=rf"{tmp_path / name}: not a readable GGUF file"):
            GGUFCheckpoint([tmp_path / name])
    with pytest.raises(ModelNotFoundError, match=r"missing\.gguf"):
        GGUFCheckpoint([tmp_path / "missing.gguf"])


# -- the real GGUFs -------------------------------------------------------------------------------


def test_embedded_smollm2() -> None:
    ckpt = GGUFCheckpoint([BUNDLED_MODELS[DEFAULT_MODEL]()])
    c = ckpt.hf_config()
    assert c.architectures == ["LlamaForCausalLM"] and c.tie_word_embeddings is True
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.head_dim) == (30, 576, 1536, 64)
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (9, 3, 49152)
    assert (c.max_position_embeddings, c.rms_norm_eps, c.bos_token_id, c.eos_token_id) == (8192, 1e-5, 1, 2)
    assert rope_parameters(c) == {"rope_type": "default", "rope_theta": 100000.0}
    layer = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
             "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{n}.weight" for i in range(30) for n in layer}
    shapes = {}
    for name, tensor, _ in ckpt.iter_weights(torch.float32):
        assert torch.isfinite(tensor).all(), name
        shapes[name] = tuple(tensor.shape)
    assert ckpt.num_tensors() == len(shapes) == 272 and set(shapes) == expected
    assert ckpt.tensor_types() == ["Q4_1", "F32", "Q8_0"]  # 210, 61 and 1 tensors
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (192, 576)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (576, 1536)


def test_gemma3_270m_config() -> None:
    try:
        path = BUNDLED_MODELS["gemma3-270m"]()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    ckpt = GGUFCheckpoint([path])
    c = ckpt.hf_config()
    assert c.architectures == ["Gemma3ForCausalLM"] and c.tie_word_embeddings is True
    assert (c.num_hidden_layers, c.hidden_size, c.num_key_value_heads, c.head_dim) == (18, 640, 1, 256)
    assert (c.query_pre_attn_scalar, c.sliding_window, c.vocab_size) == (256, 512, 262144)
    assert (c.rms_norm_eps, c.max_position_embeddings) == (1e-6, 32768)
    assert c.num_attention_heads == 4 and c.hidden_activation == "gelu_pytorch_tanh"
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert rope_parameters(c, "full_attention")["rope_theta"] == 1e6
    assert rope_parameters(c, "sliding_attention")["rope_theta"] == 1e4
    assert ckpt.num_tensors() == 236


def _mapped_rss(path: Path) -> int:
    """Bytes of `path`'s memory maps resident in this process (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[:1].isdigit() or line[:1] in "abcdef":  # a mapping's header line
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")
def test_tensors_read_leave_no_mapped_pages_behind(tmp_path: Path) -> None:
    """A load's peak memory is the copies plus one tensor, not plus the whole file: each tensor's
    mapped pages are dropped once the model took its copy."""
    rng = np.random.default_rng(0)
    tensors = {f"blk.{i}.ffn_up.weight": rng.normal(size=(1024, 2048)).astype(np.float32) for i in range(4)}
    (path,) = write_gguf(
        tmp_path / "big.gguf", "llama", {"token_embd.weight": tensors.pop("blk.0.ffn_up.weight"), **tensors}
    )
    ckpt = GGUFCheckpoint([path])
    seen = []
    for _, tensor, _ in ckpt.iter_weights(torch.float32):
        seen.append(float(tensor.sum()))  # the copy is the model's now
        assert _mapped_rss(path) <= 8 * 2**20 + 1024 * 2048 * 4, _mapped_rss(
            path
        )  # at most one tensor mapped
    assert len(seen) == 4 and _mapped_rss(path) < 8 * 2**20
