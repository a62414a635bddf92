"""Phi-3 (`Phi3ForCausalLM`) beyond the shared parity tables (tiny.py's "phi3": fused qkv and
gate_up, partial rotary, a window): LongRoPE's two factor sets against transformers in the
regime where transformers uses each, the set chosen by the served context, and Phi-3 GGUF files
(llama.cpp's `phi3`: fused or split q/k/v, quantized blocks cut into their parts unchanged)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from llmserve import LLM, SamplingParams
from llmserve.config import ModelConfig
from llmserve.layers.quantization.layers import QuantizedLinear
from llmserve.layers.rotary_embedding import rope_for_context, rope_parameters
from llmserve.load_errors import ModelLoadError
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.model_loader import load_model
from llmserve.model_executor.model_loader.gguf_loader import GGUFCheckpoint
from tests.gguf_writer import hf_metadata, with_placeholder_tokenizer, write_gguf, write_hf_model
from tests.models.tiny import _LLAMA_LIKE, assert_greedy_matches, hf_greedy, save_tiny_tokenizer

ORIGINAL = 32
"""The tiny LongRoPE model's original context (its position table: 256)."""
TOL = 3e-2  # int16 activations against float (test_quantized.py's)


def _longrope_config() -> transformers.Phi3Config:
    return transformers.Phi3Config(
        **_LLAMA_LIKE, original_max_position_embeddings=ORIGINAL, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=0, pad_token_id=None,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
            "long_factor": [1.5, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0],
        },
    )  # fmt: skip


@pytest.fixture(scope="module")
def longrope(tmp_path_factory: pytest.TempPathFactory) -> tuple[transformers.PreTrainedModel, Path]:
    folder = tmp_path_factory.mktemp("phi3-longrope")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_longrope_config(), dtype=torch.float32).eval()
    hf.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return hf, folder


def _greedy(loaded, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens from llmserve's forward, one decode step at a time through the cache."""
    runner = ForwardRunner(loaded.model, num_blocks=32, block_size=4)
    blocks, seq, out = list(range(32)), list(prompt), []
    logits = runner.execute([SequenceBatchEntry(seq, len(seq), blocks)])
    for _ in range(n):
        out.append(int(logits[0].argmax()))
        seq.append(out[-1])
        logits = runner.execute([SequenceBatchEntry([seq[-1]], len(seq), blocks)])
    return out


def test_short_factors_within_the_original_context(longrope) -> None:
    """Served with a context of at most the original (the default), the short set: transformers
    uses it for every forward whose positions stay within the original context."""
    hf, folder = longrope
    loaded = load_model(ModelConfig(model=str(folder), show_progress=False))
    assert loaded.max_model_len == ORIGINAL and "LongRoPE short factors" in loaded.summary()
    prompt = [5, 17, 99, 3, 200, 1, 45, 67]
    want, _ = hf_greedy(hf, prompt, ORIGINAL - len(prompt))
    assert _greedy(loaded, prompt, ORIGINAL - len(prompt)) == want


def test_long_factors_past_the_original_context(longrope) -> None:
    """Served with the whole position table, the long set: transformers uses it once a forward
    reaches past the original context, so a prompt longer than that compares token for token."""
    hf, folder = longrope
    loaded = load_model(ModelConfig(model=str(folder), max_model_len=256, show_progress=False))
    assert "LongRoPE long factors" in loaded.summary()
    prompt = torch.randint(1, 500, (ORIGINAL + 8,), generator=torch.Generator().manual_seed(3)).tolist()
    want, _ = hf_greedy(hf, prompt, 24)
    assert _greedy(loaded, prompt, 24) == want
    # and the attention factor: sqrt(1 + ln(256 / 32) / ln(32)) scales the table, as in transformers
    table = loaded.model.model.rotary_emb.cos_sin_cache
    assert float(table[0, 0]) == pytest.approx((1 + np.log(256 / ORIGINAL) / np.log(ORIGINAL)) ** 0.5)


def test_the_factor_set_follows_the_context_not_the_batch(longrope) -> None:
    """One choice per engine: a short prompt under the long set is not switched to the short one
    (transformers would), so it differs from the short-set engine's logits."""
    _, folder = longrope
    short = load_model(ModelConfig(model=str(folder), max_model_len=ORIGINAL, show_progress=False))
    long = load_model(ModelConfig(model=str(folder), max_model_len=ORIGINAL + 1, show_progress=False))
    prompt = [5, 17, 99, 3]
    entry = [SequenceBatchEntry(prompt, len(prompt), [0])]
    a = ForwardRunner(short.model, num_blocks=4, block_size=4).execute(entry, all_logits=True)
    b = ForwardRunner(long.model, num_blocks=4, block_size=4).execute(entry, all_logits=True)
    assert not torch.allclose(a, b, atol=1e-3)
    params = rope_parameters(rope_for_context(short.hf_config, ORIGINAL + 1))
    assert params["use_long_factor"] and "use_long_factor" not in rope_parameters(short.hf_config)


# -- GGUF files ---------------------------------------------------------------------------------


def _phi3_config() -> transformers.Phi3Config:
    # widths that Q8_0 / Q4_0 blocks (32) divide; Phi-4-mini's partial rotary; a window
    return transformers.Phi3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=256,
        partial_rotary_factor=0.75, sliding_window=16, initializer_range=0.15, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=0, pad_token_id=None,
    )  # fmt: skip


def _phi3_gguf(tmp: Path, qtype: Q, split_qkv: bool = False) -> tuple[transformers.PreTrainedModel, Path]:
    """A tiny Phi-3 as llama.cpp converts it, its matrices in `qtype`; `split_qkv`: q, k and v as
    three tensors (llama.cpp reads either)."""
    config = _phi3_config()
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(config).eval()
    config.architectures = ["Phi3ForCausalLM"]
    path = write_hf_model(tmp / "f32.gguf", "phi3", config, hf.state_dict())[0]
    tensors: dict = {}
    q, kv = 64, 32
    for t in GGUFReader(path).tensors:
        arr = np.array(t.data).reshape(list(reversed(t.shape.tolist())))
        if split_qkv and t.name.endswith("attn_qkv.weight"):
            base = t.name.removesuffix("attn_qkv.weight")
            for part, rows in (("attn_q", arr[:q]), ("attn_k", arr[q : q + kv]), ("attn_v", arr[q + kv :])):
                tensors[f"{base}{part}.weight"] = (np.ascontiguousarray(rows), qtype)
        elif arr.ndim == 2:
            tensors[t.name] = (arr, qtype)
        else:
            tensors[t.name] = arr
    metadata = with_placeholder_tokenizer(hf_metadata("phi3", config), config.vocab_size)
    return hf, write_gguf(tmp / "phi3.gguf", "phi3", tensors, metadata)[0]


@pytest.mark.parametrize("split_qkv", [False, True], ids=["attn_qkv", "attn_q_k_v"])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_gguf_blocks_reach_the_parts_unchanged(tmp_path: Path, qtype: Q, split_qkv: bool) -> None:
    """The fused qkv and gate_up tensors are cut into q, k, v and gate, up as the file's blocks
    (the layer holds exactly the file's values), and the quantized model matches the same file
    dequantized to float."""
    _, path = _phi3_gguf(tmp_path, qtype, split_qkv)
    quant = load_model(ModelConfig(model=str(path), cpu_activations="int16", show_progress=False))
    plain = load_model(ModelConfig(model=str(path), quantization="none", show_progress=False))
    layer = quant.model.model.layers[1]
    qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    assert isinstance(qkv, QuantizedLinear) and qkv.fmt == ("q8" if qtype == Q.Q8_0 else "q4")
    floats = dict((n, t) for n, t, _ in GGUFCheckpoint([path]).iter_weights(torch.float32))
    prefix = "model.layers.1."
    want_qkv = (
        torch.cat([floats[f"{prefix}self_attn.{p}_proj.weight"] for p in "qkv"])
        if split_qkv
        else floats[f"{prefix}self_attn.qkv_proj.weight"]
    )
    assert torch.equal(qkv.logical_weight(), want_qkv)
    assert torch.equal(gate_up.logical_weight(), floats[f"{prefix}mlp.gate_up_proj.weight"])

    prompt = [5, 17, 99, 3, 200, 1, 1, 45, 67, 30, 12, 9, 8, 7, 6, 5, 4, 3, 2, 11]  # past the window
    entry = [SequenceBatchEntry(prompt, len(prompt), list(range(5)))]
    got = ForwardRunner(quant.model, num_blocks=8, block_size=4).execute(entry, all_logits=True)
    ref = ForwardRunner(plain.model, num_blocks=8, block_size=4).execute(entry, all_logits=True)
    torch.testing.assert_close(got, ref, rtol=TOL, atol=TOL)


def test_gguf_f32_engine_matches_transformers(tmp_path: Path) -> None:
    """The whole engine (`LLM`) on an F32 Phi-3 GGUF: greedy tokens and logprobs equal
    transformers' on the HF model the file was written from."""
    hf, path = _phi3_gguf(tmp_path, Q.F32)
    prompt = [5, 17, 99, 3, 200, 1, 45, 67]
    want, logits = hf_greedy(hf, prompt, 24)
    llm = LLM(str(path), show_progress=False)
    [out] = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(max_tokens=24, temperature=0, logprobs=2, ignore_eos=True),
    )
    assert_greedy_matches(out.outputs[0], want, [torch.log_softmax(x, -1) for x in logits])


def test_prequantized_fused_tensors_are_refused_by_name(tmp_path: Path) -> None:
    from llmserve.model_executor.model_loader.fused_tensors import split_fused

    splits = {
        "self_attn.qkv_proj": (("self_attn.q_proj", 2), ("self_attn.k_proj", 1), ("self_attn.v_proj", 1))
    }
    stream = [("model.layers.0.self_attn.qkv_proj.qweight", torch.zeros(4, 4), "x.safetensors")]
    with pytest.raises(ModelLoadError, match="qkv_proj.qweight"):
        list(split_fused(stream, splits))
    wrong = [("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(5, 4), "x.safetensors")]
    with pytest.raises(ModelLoadError, match=r"\[4, 4\]"):
        list(split_fused(wrong, splits))
    parts = list(split_fused([("model.layers.0.self_attn.qkv_proj.bias", torch.arange(4.0), "f")], splits))
    assert [(n, t.tolist()) for n, t, _ in parts] == [
        ("model.layers.0.self_attn.q_proj.bias", [0.0, 1.0]),
        ("model.layers.0.self_attn.k_proj.bias", [2.0]),
        ("model.layers.0.self_attn.v_proj.bias", [3.0]),
    ]


def test_lora_on_the_fused_layers_matches_peft(tmp_path: Path) -> None:
    """A PEFT adapter of Phi-3 targets its fused qkv_proj and gate_up_proj as single layers:
    each is applied per shard (the whole A, the shard's rows of B), against PEFT's logits."""
    pytest.importorskip("peft")
    from llmserve.lora import LoRARequest
    from tests.models.test_lora import TOL, make_adapter, make_runner, peft_reference, run_mixed
    from tests.models.tiny import make_tiny_model

    folder = tmp_path / "phi3"
    make_tiny_model("phi3", folder)
    adapters = [
        make_adapter(folder, tmp_path / "all", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], seed=1),
        make_adapter(folder, tmp_path / "some", ["qkv_proj", "down_proj"], seed=2),
    ]
    runner, manager = make_runner(folder, "none")
    for i, path in enumerate(adapters, start=1):
        manager.add(LoRARequest(f"a{i}", i, str(path)))
    got = run_mixed(runner, [1, 2, 0])
    prompts = [[5, 17, 99, 3, 8, 9], [200, 1, 1, 45, 67, 300, 12], [42, 43]]
    plain = peft_reference(folder, None, "none")
    for i, adapter in enumerate([*adapters, None]):
        seq = prompts[i] + [7, 8, 9]
        with torch.no_grad():
            ref = peft_reference(folder, adapter, "none")(torch.tensor([seq])).logits[0]
            without = plain(torch.tensor([seq])).logits[0]
        torch.testing.assert_close(got[i], ref, rtol=TOL, atol=TOL)
        if adapter is not None:
            assert (ref - without).abs().max() > 0.1
