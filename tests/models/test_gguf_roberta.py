"""RoBERTa encoders with a byte-level BPE vocabulary in GGUF (granite-embedding as Ollama ships
it): llama.cpp's `bert` architecture with a `gpt2` vocabulary and the `roberta-bpe` pre-tokenizer,
the position table without RoBERTa's first pad + 1 rows, as its converter (RobertaModel) writes
them. The same ids as the HF tokenizer (`<s> text </s>`), the same vectors as transformers'
`RobertaModel` pooled the same way."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import tokenizers
import torch
import transformers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from llmserve import LLM, PoolingParams
from tests.gguf_writer import add_encoder_metadata, convert_state_dict, hf_vocab, write_gguf

SPECIAL = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
TEXTS = ["The quick brown fox", "jumps over the lazy dog. 0123456789", "naïve café", " leading space"]


def save_bpe_tokenizer(folder: Path, special: list[str], post_processor: processors.PostProcessor) -> int:
    """A byte-level BPE trained on a few sentences with an encoder's `special` tokens (first ids)
    and template, saved as tokenizer.json; its vocabulary size."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(
        ["The quick brown fox jumps over the lazy dog. 0123456789 naïve café."] * 50, trainer
    )
    tok.post_processor = post_processor
    tok.save(str(folder / "tokenizer.json"))
    return tok.get_vocab_size()


def check_mean_embeddings(folder: Path, hf: torch.nn.Module, llm: LLM, texts: list[str]) -> None:
    """The HF tokenizer's ids (a pair's too), and transformers' final states mean-pooled, normalised."""
    reference = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert llm.engine.default_pooling == PoolingParams("mean", True)
    for out, text in zip(llm.embed(texts, use_tqdm=False), texts, strict=True):
        assert out.prompt_token_ids == reference.encode(text).ids
        with torch.no_grad():
            ref = hf(torch.tensor([out.prompt_token_ids])).last_hidden_state[0].mean(0)
        torch.testing.assert_close(
            torch.tensor(out.embedding), torch.nn.functional.normalize(ref, dim=0), rtol=1e-4, atol=1e-5
        )
    assert (
        llm.get_tokenizer().backend.encode(texts[0], texts[-1]).ids
        == reference.encode(texts[0], texts[-1]).ids
    )


def check_pair_scores(folder: Path, hf: torch.nn.Module, llm: LLM, query: str, docs: list[str]) -> None:
    """A one-label reranker: each pair as the HF tokenizer encodes it, scored with the sigmoid of
    transformers' logit (sentence-transformers' CrossEncoder), the scores apart from each other."""
    assert llm.engine.is_cross_encoder
    reference = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    outs = llm.score(query, docs, use_tqdm=False)
    for out, doc in zip(outs, docs, strict=True):
        ids = reference.encode(query, doc).ids
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            logit = hf(torch.tensor([ids])).logits[0, 0]
        assert out.score == pytest.approx(logit.sigmoid().item(), abs=1e-5)
    assert max(o.score for o in outs) - min(o.score for o in outs) > 1e-3


def save_roberta(folder: Path) -> transformers.RobertaModel:
    """A byte-level BPE trained on a few sentences with RoBERTa's special tokens and template,
    beside a tiny random `RobertaModel` of its vocabulary."""
    vocab_size = save_bpe_tokenizer(
        folder, SPECIAL, processors.RobertaProcessing(("</s>", 2), ("<s>", 0), add_prefix_space=False)
    )
    config = transformers.RobertaConfig(
        vocab_size=vocab_size, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=96, max_position_embeddings=66, type_vocab_size=1, pad_token_id=1,
        bos_token_id=0, eos_token_id=2, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.RobertaModel(config, add_pooling_layer=False).eval()
    hf.save_pretrained(folder)
    return hf


def write_roberta_gguf(folder: Path, hf: transformers.RobertaModel) -> Path:
    config, offset = hf.config, hf.config.pad_token_id + 1
    state = dict(hf.state_dict())
    state["embeddings.position_embeddings.weight"] = state["embeddings.position_embeddings.weight"][offset:]
    state.pop("embeddings.position_ids", None)
    tensors = convert_state_dict("bert", config, state)
    tokens, types, merges = hf_vocab(folder)

    def metadata(w: gguf.GGUFWriter) -> None:
        add_encoder_metadata(w, config, config.max_position_embeddings - offset, gguf.PoolingType.MEAN)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("roberta-bpe")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_token_type_count(config.type_vocab_size)
        w.add_bos_token_id(0)
        w.add_pad_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(3)
        w.add_sep_token_id(2)
        w.add_add_bos_token(True)
        w.add_add_eos_token(True)

    (path,) = write_gguf(folder / "roberta.gguf", "bert", dict(tensors), metadata)
    return path


@pytest.fixture(scope="module")
def roberta(tmp_path_factory) -> tuple[Path, transformers.RobertaModel, LLM]:
    folder = tmp_path_factory.mktemp("roberta-bpe")
    hf = save_roberta(folder)
    return folder, hf, LLM(str(write_roberta_gguf(folder, hf)), show_progress=False, device="cpu")


def test_ids_and_embeddings_match_the_hf_model(roberta):
    """<s> text </s> as the HF tokenizer writes it, and transformers' vectors."""
    check_mean_embeddings(*roberta, TEXTS)
