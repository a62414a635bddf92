"""EmbeddingGemma's layout (models/gemma3_embedding.py): a tiny `Gemma3TextModel` with bidirectional
attention saved with sentence-transformers' modules (mean pooling, two Dense layers without biases,
Normalize), against transformers' hidden states put through the same pooling and Dense layers by
hand, and against sentence-transformers' `SentenceTransformer.encode` on the same folder."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from llmserve import LLM, PoolingParams
from llmserve.errors import ParameterError
from tests.models.tiny import TINY_CONFIGS, save_tiny_tokenizer

TEXTS = ["The quick brown fox", "jumps over the lazy dog. 0123456789 " * 3, "café", "naïve fox"]
DENSE = 96  # the Dense layers: hidden -> DENSE -> hidden, as EmbeddingGemma's 768 -> 3072 -> 768


def save_embedding_gemma(
    folder: Path, seed: int = 0, llama_cpp_shape: bool = False
) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """`llama_cpp_shape`: what llama.cpp assumes of the files it reads (not written in them): five
    sliding layers then a full one, and 1 / sqrt(head_dim) as the attention scale."""
    config = TINY_CONFIGS["gemma3"]()
    if llama_cpp_shape:
        config.num_hidden_layers = 6
        config.layer_types = ["sliding_attention"] * 5 + ["full_attention"]
        config.query_pre_attn_scalar = config.head_dim
    config.use_bidirectional_attention = True
    config.sliding_window = 4  # shorter than most inputs: the window matters
    config.num_key_value_heads = 1  # EmbeddingGemma's grouped-query attention (3 heads, 1 KV head)
    torch.manual_seed(seed)
    hf = transformers.Gemma3TextModel(config).eval()
    hf.save_pretrained(folder)
    save_tiny_tokenizer(folder, config.vocab_size)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**tok_config, "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<|endoftext|>"})
    )
    H = config.hidden_size
    dense = [torch.randn(DENSE, H) / H**0.5, torch.randn(H, DENSE) / DENSE**0.5]
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 4, "name": "4", "path": "4_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": H, "pooling_mode_mean_tokens": True})
    )
    for path, w in zip(("2_Dense", "3_Dense"), dense, strict=True):
        (folder / path).mkdir()
        (folder / path / "config.json").write_text(json.dumps({
            "in_features": w.shape[1], "out_features": w.shape[0], "bias": False,
            "activation_function": "torch.nn.modules.linear.Identity",
        }))  # fmt: skip
        save_file({"linear.weight": w.contiguous()}, str(folder / path / "model.safetensors"))
    (folder / "4_Normalize").mkdir()
    return hf, dense


def reference(hf: torch.nn.Module, dense: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        pooled = hf(torch.tensor([ids])).last_hidden_state[0].mean(0)
    return torch.nn.functional.normalize(pooled @ dense[0].T @ dense[1].T, dim=0)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, torch.nn.Module, list[torch.Tensor], LLM]:
    folder = tmp_path_factory.mktemp("embedding-gemma")
    hf, dense = save_embedding_gemma(folder)
    return folder, hf, dense, LLM(str(folder), show_progress=False, device="cpu")


def test_embeddings_match_transformers_pooled_and_projected(model):
    """Mean-pooled final states through the two Dense layers, normalised; the sliding layers' window
    is transformers' (|i - j| < sliding_window, both ways) and matters on the longer inputs."""
    _folder, hf, dense, llm = model
    assert llm.engine.default_pooling == PoolingParams("mean", True)
    outs = llm.embed(TEXTS, use_tqdm=False)
    for out in outs:
        ref = reference(hf, dense, out.prompt_token_ids)
        torch.testing.assert_close(torch.tensor(out.embedding), ref, rtol=1e-4, atol=1e-5)
    # the window matters: with every layer global the long input's vector moves
    long = max(outs, key=lambda o: len(o.prompt_token_ids))
    hf.config.layer_types = ["full_attention"] * hf.config.num_hidden_layers
    try:
        moved = reference(hf, dense, long.prompt_token_ids)
    finally:
        hf.config.layer_types = ["sliding_attention", "full_attention"]
    assert (moved - torch.tensor(long.embedding)).abs().max() > 1e-3


def test_matryoshka_dimensions_cut_the_projected_vector(model):
    _, hf, dense, llm = model
    (out,) = llm.embed([TEXTS[0]], PoolingParams("mean", True, dimensions=16), use_tqdm=False)
    full = reference(hf, dense, out.prompt_token_ids)
    torch.testing.assert_close(
        torch.tensor(out.embedding), torch.nn.functional.normalize(full[:16], dim=0), rtol=1e-4, atol=1e-5
    )
    with pytest.raises(ParameterError, match="embedding size 64"):
        llm.embed([TEXTS[0]], PoolingParams("mean", True, dimensions=65), use_tqdm=False)


@pytest.mark.skipif(importlib.util.find_spec("sentence_transformers") is None, reason="sentence-transformers")
def test_embeddings_match_sentence_transformers(model):
    from sentence_transformers import SentenceTransformer

    folder, _, _, llm = model
    ref = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    got = torch.tensor([o.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    torch.testing.assert_close(got, ref.float(), rtol=1e-4, atol=1e-5)


def test_a_causal_gemma3_backbone_is_refused_by_name(tmp_path):
    config = TINY_CONFIGS["gemma3"]()
    transformers.Gemma3TextModel(config).save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path, config.vocab_size)
    with pytest.raises(ValueError, match="without use_bidirectional_attention"):
        LLM(str(tmp_path), show_progress=False, device="cpu")


def test_an_embedding_gemma_gguf_matches_transformers(tmp_path):
    """llama.cpp's `gemma-embedding` file (its converter with `--sentence-transformers-dense-modules`:
    Gemma 3's tensors, `dense_2` and `dense_3`, MEAN pooling, config.json's window): the same
    vectors as transformers' model pooled and projected. Checked once by hand against llama.cpp
    itself: its converter's file of such a model (SmolLM2's vocabulary) loads to the same vectors as
    the HF folder (max difference 0.0), and llama-server's embeddings of it agree (cosine >= 0.9999997,
    the same tokens)."""
    import gguf

    from tests.gguf_writer import add_bpe_vocab, convert_state_dict, hf_metadata, hf_vocab, write_gguf

    hf, dense = save_embedding_gemma(tmp_path, seed=1, llama_cpp_shape=True)
    config = hf.config
    state = {f"model.{k}": v for k, v in hf.state_dict().items()}
    tensors = dict(convert_state_dict("gemma3", config, state))
    tensors["dense_2.weight"], tensors["dense_3.weight"] = (w.numpy() for w in dense)
    base, vocab = hf_metadata("gemma3", config), hf_vocab(tmp_path)

    def metadata(w: gguf.GGUFWriter) -> None:
        base(w)
        add_bpe_vocab(w, vocab, "gpt-2")
        w.kv_data[0].pop("gemma-embedding.attention.sliding_window")
        w.add_sliding_window(
            (config.sliding_window - 1) * 2
        )  # config.json's value, as the converter writes it
        w.add_pooling_type(gguf.PoolingType.MEAN)

    (path,) = write_gguf(tmp_path / "embeddinggemma.gguf", "gemma-embedding", tensors, metadata)
    llm = LLM(str(path), show_progress=False, device="cpu")
    assert llm.engine.default_pooling == PoolingParams("mean", True)
    for out in llm.embed(TEXTS, use_tqdm=False):
        ref = reference(hf, dense, out.prompt_token_ids)
        torch.testing.assert_close(torch.tensor(out.embedding), ref, rtol=1e-4, atol=1e-5)
