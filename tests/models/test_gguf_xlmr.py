"""XLM-RoBERTa encoders in GGUF (BGE-M3, multilingual-E5 as Ollama and llama.cpp ship them): the
`bert` architecture with llama.cpp's `t5` (sentencepiece Unigram) vocabulary. A tiny XLM-R is made
from a sentencepiece model trained here with NFKC normalisation (transformers converts it to the
HF tokenizer, the reference), written as llama.cpp's converter writes it (pieces and scores in HF's
id order, the precompiled charsmap, the position table without RoBERTa's first pad + 1 rows), then
tokenized and embedded: the same ids as the HF tokenizer, the same vectors as transformers'
`XLMRobertaModel`. Checked once by hand against llama.cpp itself: its converter's file of this model
loads to the same ids and vectors, and llama-server's embeddings of it agree (docs/benchmarks.md)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import tokenizers
import torch
import transformers

from llmserve import LLM, PoolingParams
from tests.gguf_writer import add_encoder_metadata, convert_state_dict, write_gguf
from tests.models.test_gguf_roberta import check_pair_scores

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Naïve café, déjà vu! 123,456.78",
    "Ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ and ﬁ ligatures",
    "Hello world, hello llmserve.",
    "中文 日本語 한국어",
]
TEXTS = [
    "Ｆｕｌｌｗｉｄｔｈ ﬁ text",
    "  several   spaces\tand\na newline ",
    "Naïve café 123",
    "中文 fox",
    "unseen ✓ piece",
]


def save_xlmr(folder: Path, reranker: bool = False) -> transformers.PreTrainedModel:
    """A sentencepiece Unigram model (nmt_nfkc) trained on CORPUS, converted by transformers to
    XLM-R's tokenizer, beside a tiny random `XLMRobertaModel` of its vocabulary (`reranker`: an
    `XLMRobertaForSequenceClassification` of one label, as bge-reranker-v2-m3)."""
    import sentencepiece as spm

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 40), model_writer=proto, vocab_size=200, model_type="unigram",
        normalization_rule_name="nmt_nfkc", character_coverage=1.0, hard_vocab_limit=False, minloglevel=2,
    )  # fmt: skip
    spm_dir = folder / "spm"
    spm_dir.mkdir()
    (spm_dir / "sentencepiece.bpe.model").write_bytes(proto.getvalue())
    tok = transformers.XLMRobertaTokenizer.from_pretrained(spm_dir)
    tok.save_pretrained(folder)
    config = transformers.XLMRobertaConfig(
        vocab_size=len(tok), hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        max_position_embeddings=130, type_vocab_size=1, pad_token_id=tok.pad_token_id, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    if reranker:
        config.num_labels = 1
        hf = transformers.XLMRobertaForSequenceClassification(config).eval()
    else:
        hf = transformers.XLMRobertaModel(config, add_pooling_layer=False).eval()
    hf.save_pretrained(folder)
    return hf


def write_xlmr_gguf(folder: Path, hf: transformers.XLMRobertaModel) -> Path:
    """What llama.cpp's converter writes for an XLM-R folder (its XLMRobertaModel class)."""
    config, vocab = hf.config, json.loads((folder / "tokenizer.json").read_text())
    offset = config.pad_token_id + 1  # RoBERTa's positions start after the pad id: the converter cuts them
    state = {k.removeprefix("roberta."): v for k, v in hf.state_dict().items()}
    state["embeddings.position_embeddings.weight"] = state["embeddings.position_embeddings.weight"][offset:]
    state.pop("embeddings.position_ids", None)
    tensors = convert_state_dict("bert", config, state)
    pieces = vocab["model"]["vocab"]  # [[piece, score], ...] in id order
    special = {t["id"]: t["content"] for t in vocab["added_tokens"]}
    unk_id = vocab["model"]["unk_id"]
    types = [
        gguf.TokenType.UNKNOWN
        if i == unk_id
        else gguf.TokenType.CONTROL
        if i in special
        else gguf.TokenType.NORMAL
        for i in range(len(pieces))
    ]
    ids = {t: i for i, t in special.items()}

    def metadata(w: gguf.GGUFWriter) -> None:
        pooling = gguf.PoolingType.RANK if "classifier.dense.weight" in state else gguf.PoolingType.CLS
        add_encoder_metadata(w, config, config.max_position_embeddings - offset, pooling)
        w.add_tokenizer_model("t5")
        w.add_tokenizer_pre("default")
        w.add_token_list([p for p, _ in pieces])
        w.add_token_scores([float(s) for _, s in pieces])
        w.add_token_types([int(t) for t in types])
        w.add_add_space_prefix(True)
        w.add_token_type_count(config.type_vocab_size)
        w.add_remove_extra_whitespaces(True)
        w.add_precompiled_charsmap(base64.b64decode(vocab["normalizer"]["precompiled_charsmap"]))
        w.add_bos_token_id(ids["<s>"])
        w.add_eos_token_id(ids["</s>"])
        w.add_unk_token_id(unk_id)
        w.add_sep_token_id(ids["</s>"])
        w.add_pad_token_id(ids["<pad>"])
        w.add_mask_token_id(ids["<mask>"])
        w.add_add_bos_token(True)
        w.add_add_eos_token(True)

    (path,) = write_gguf(folder / "xlmr.gguf", "bert", dict(tensors), metadata)
    return path


@pytest.fixture(scope="module")
def xlmr(tmp_path_factory) -> tuple[Path, transformers.XLMRobertaModel, LLM]:
    folder = tmp_path_factory.mktemp("xlmr")
    hf = save_xlmr(folder)
    llm = LLM(str(write_xlmr_gguf(folder, hf)), show_progress=False, device="cpu")
    return folder, hf, llm


def test_the_unigram_vocabulary_tokenizes_as_the_hf_tokenizer(xlmr):
    """NFKC through the precompiled charsmap (full-width letters, the ﬁ ligature), whitespace runs
    collapsed, "▁" before each word, `<s> ... </s>`; a pair as RoBERTa's `<s> a </s></s> b </s>`."""
    folder, _, llm = xlmr
    reference = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok = llm.get_tokenizer()
    for text in TEXTS:
        assert tok.encode(text) == reference.encode(text).ids, text
    assert tok.backend.encode(TEXTS[2], TEXTS[3]).ids == reference.encode(TEXTS[2], TEXTS[3]).ids
    assert tok.decode(tok.encode(TEXTS[2])) == "Naïve café 123"


def test_embeddings_match_transformers(xlmr):
    """The file's CLS pooling, normalised, against transformers' first-token state."""
    _, hf, llm = xlmr
    assert llm.engine.default_pooling == PoolingParams("cls", True)
    for out in llm.embed(TEXTS, use_tqdm=False):
        with torch.no_grad():
            ref = hf(torch.tensor([out.prompt_token_ids])).last_hidden_state[0, 0]
        torch.testing.assert_close(
            torch.tensor(out.embedding), torch.nn.functional.normalize(ref, dim=0), rtol=1e-4, atol=1e-5
        )
    assert np.isfinite(np.array(llm.embed([TEXTS[0] * 2], use_tqdm=False)[0].embedding)).all()


def test_an_xlmr_reranker_gguf_scores_pairs_as_transformers(tmp_path):
    """bge-reranker-v2-m3's layout in GGUF (`cls` and `cls.output`: RoBERTa's classification head,
    `pooling_type` RANK): each pair read as `<s> query </s></s> document </s>` and scored with
    the sigmoid of transformers' logit (sentence-transformers' CrossEncoder; llama-server answers
    the logit itself, the same order)."""
    hf = save_xlmr(tmp_path, reranker=True)
    llm = LLM(str(write_xlmr_gguf(tmp_path, hf)), show_progress=False, device="cpu")
    check_pair_scores(tmp_path, hf, llm, CORPUS[0], [CORPUS[1], TEXTS[0], CORPUS[0], TEXTS[3]])
