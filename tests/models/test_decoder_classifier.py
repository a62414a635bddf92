"""Decoder LMs as sequence classifiers (models/decoder_classifier.py) against transformers: HF's
`Llama/Qwen2/Qwen3ForSequenceClassification` (a one-label reranker or reward model: sigmoid of the
last token's logit; three labels: softmax), the original Qwen3-Reranker's layout, a causal LM
scored through `hf_overrides` as the two-way softmax of its "no" and "yes" logits, and a Qwen3-Reranker
GGUF as llama.cpp's converter writes it (`cls.output`, RANK pooling, a `rerank` template). Checked once
by hand against llama.cpp itself: llama-server `--reranking` on the GGUF test's file gave the same
tokens for every pair and scores within 3e-4 of these (its KV cache is float16)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
import torch
import transformers

from llmserve import LLM, SamplingParams
from llmserve.errors import ParameterError
from tests.models.tiny import TINY_CONFIGS, make_tiny_model, save_tiny_tokenizer

QUERY = "The quick brown fox"
DOCS = ["jumps over", "the lazy dog. 0123", "café", "naïve fox jumps over the quick brown dog"]
RERANKER = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}


def save_classifier(folder: Path, name: str, num_labels: int, seed: int = 0) -> torch.nn.Module:
    config = TINY_CONFIGS[name]()
    config.num_labels = num_labels
    if num_labels > 1:
        config.id2label = {i: f"label-{i}" for i in range(num_labels)}
        config.label2id = {v: k for k, v in config.id2label.items()}
    torch.manual_seed(seed)
    hf = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers initialises the head small: make its scores spread
        hf.score.weight.normal_(0, 0.5)
    hf.save_pretrained(folder)
    save_tiny_tokenizer(folder, config.vocab_size)
    return hf


def pair_ids(folder: Path, a: str, b: str) -> list[int]:
    """A pair as the folder's tokenizer.json encodes it (a byte-level BPE without a template: a + b;
    read with `tokenizers`, since transformers' Qwen2 tokenizer class swaps in Qwen's own splitting)."""
    return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).encode(a, b).ids


def text_ids(folder: Path, text: str) -> list[int]:
    return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids


def hf_last_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The last token's logits: a classifier's [labels] (transformers pools it), a causal LM's [vocab]."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    return logits[-1] if logits.dim() == 2 else logits


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_a_one_label_decoder_classifier_scores_pairs_as_transformers(tmp_path, name):
    """`LLM.score`: each pair's tokens as transformers' tokenizer joins them, scored with the
    sigmoid of transformers' logit on the last token; the model refuses generation."""
    hf = save_classifier(tmp_path, name, num_labels=1)
    llm = LLM(str(tmp_path), show_progress=False, device="cpu", num_kv_blocks=64, block_size=4)
    assert llm.engine.is_cross_encoder
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    for out, doc in zip(outs, DOCS, strict=True):
        ids = pair_ids(tmp_path, QUERY, doc)
        assert out.prompt_token_ids == ids
        assert out.score == pytest.approx(hf_last_logits(hf, ids)[0].sigmoid().item(), abs=1e-5)
    assert len({round(o.score, 4) for o in outs}) == len(DOCS)  # the documents do score apart
    with pytest.raises(ParameterError, match="cross-encoder.*/v1/rerank"):
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)


def test_a_three_label_decoder_classifier_matches_transformers(tmp_path):
    """`LLM.classify`: softmax over the three labels of transformers' last-token logits, the label
    named by id2label; the score routes refuse it (not a cross-encoder)."""
    hf = save_classifier(tmp_path, "qwen3", num_labels=3, seed=4)
    llm = LLM(str(tmp_path), show_progress=False, device="cpu", num_kv_blocks=64, block_size=4)
    texts = [QUERY, DOCS[1], DOCS[3] * 3]
    for out, text in zip(llm.classify(texts, use_tqdm=False), texts, strict=True):
        ref = hf_last_logits(hf, text_ids(tmp_path, text)).softmax(-1)
        torch.testing.assert_close(torch.tensor(out.probs), ref, rtol=1e-5, atol=1e-5)
        assert out.label == f"label-{int(ref.argmax())}"
    with pytest.raises(ParameterError, match="classifier of 3 labels"):
        llm.score(QUERY, DOCS, use_tqdm=False)


@pytest.mark.parametrize("tied", [True, False], ids=["tied-embedding", "lm-head"])
def test_the_original_qwen3_reranker_layout_scores_p_yes(tmp_path, tied):
    """A causal LM with vLLM's overrides: the score is P("yes") of the two-way softmax over the
    "no" and "yes" logits of transformers' causal LM at the last token, from the LM head's rows
    (or the embedding's, where the head is tied to it)."""
    config = TINY_CONFIGS["qwen3"]()
    config.tie_word_embeddings = tied
    torch.manual_seed(2)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # the tiny head's logits lie close together: spread the two rows apart
        hf.get_output_embeddings().weight[-2:].normal_(0, 0.2)
    hf.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path, config.vocab_size, special=("no", "yes"))
    no, yes = config.vocab_size - 2, config.vocab_size - 1
    llm = LLM(str(tmp_path), show_progress=False, device="cpu", num_kv_blocks=64, block_size=4,
              hf_overrides=RERANKER)  # fmt: skip
    assert llm.engine.classifier_labels == ["yes"]
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    for out, doc in zip(outs, DOCS, strict=True):
        logits = hf_last_logits(hf, pair_ids(tmp_path, QUERY, doc))
        ref = torch.log_softmax(logits[[no, yes]], dim=0)[1].exp().item()
        assert out.score == pytest.approx(ref, abs=1e-5)
    assert max(o.score for o in outs) - min(o.score for o in outs) > 0.01


def test_classifier_tokens_as_labels(tmp_path):
    """`classifier_from_token` without the two-way method: one label a token, softmax over their
    logits (vLLM's `no_post_processing` rows), labels named by the tokens."""
    hf = make_tiny_model("qwen3", tmp_path, seed=5, special=("no", "yes", "maybe"))
    n = hf.config.vocab_size
    overrides = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": ["no", "yes", "maybe"],
    }
    llm = LLM(str(tmp_path), show_progress=False, device="cpu", num_kv_blocks=64, block_size=4,
              hf_overrides=json.dumps(overrides))  # fmt: skip
    (out,) = llm.classify([DOCS[3]], use_tqdm=False)
    ref = hf_last_logits(hf, text_ids(tmp_path, DOCS[3]))[[n - 3, n - 2, n - 1]].softmax(-1)
    torch.testing.assert_close(torch.tensor(out.probs), ref, rtol=1e-5, atol=1e-5)
    assert out.label == ["no", "yes", "maybe"][int(ref.argmax())]


def test_bad_overrides_are_value_errors_naming_them(tmp_path):
    make_tiny_model("qwen3", tmp_path, special=("no", "yes"))
    for overrides, match in [
        ("[1, 2]", "hf_overrides must be a JSON object"),
        ("{not json", "hf_overrides must be a JSON object"),
        ({**RERANKER, "classifier_from_token": ["no", "absent-token"]}, "'absent-token' is not a token"),
        ({**RERANKER, "classifier_from_token": ["no"]}, "needs two classifier_from_token"),
        ({**RERANKER, "method": "from_4_way"}, "method 'from_4_way' is not supported"),
    ]:
        with pytest.raises(ValueError, match=match):
            LLM(str(tmp_path), show_progress=False, device="cpu", num_kv_blocks=16, hf_overrides=overrides)


def test_overrides_reach_a_config_field(tmp_path):
    """A plain override changes the model as the same config.json field would: a shorter context."""
    make_tiny_model("qwen3", tmp_path)
    llm = LLM(str(tmp_path), show_progress=False, device="cpu", num_kv_blocks=16,
              hf_overrides={"max_position_embeddings": 40})  # fmt: skip
    assert llm.engine.max_model_len == 40


RERANK_TEMPLATE = "Judge: yes or no.\nQuery: {query}\nDocument: {document}\nAnswer: "


def write_reranker_gguf(folder: Path, hf: torch.nn.Module, no: int, yes: int) -> Path:
    """The Qwen3 causal LM as llama.cpp's converter writes a Qwen3-Reranker: `pooling_type` RANK, a
    `cls.output` tensor of the LM head's "yes" then "no" rows, the labels, and a `rerank` template."""
    import gguf

    from tests.gguf_writer import add_bpe_vocab, convert_state_dict, hf_metadata, hf_vocab, write_gguf

    tensors = dict(convert_state_dict("qwen3", hf.config, hf.state_dict()))
    head = hf.get_output_embeddings().weight.detach()
    tensors["cls.output.weight"] = torch.stack([head[yes], head[no]]).numpy()
    vocab = hf_vocab(folder)
    base = hf_metadata("qwen3", hf.config)

    def metadata(w: gguf.GGUFWriter) -> None:
        base(w)
        add_bpe_vocab(w, vocab, "gpt-2")
        w.add_pooling_type(gguf.PoolingType.RANK)
        w.add_classifier_output_labels(["yes", "no"])
        w.add_chat_template([{"name": "rerank", "template": RERANK_TEMPLATE}])

    return write_gguf(folder / "reranker.gguf", "qwen3", tensors, metadata)[0]


def test_a_qwen3_reranker_gguf_scores_p_yes_in_its_rerank_template(tmp_path):
    """A Qwen3-Reranker GGUF (llama.cpp's layout): each pair is written into the file's `rerank`
    template as llama-server writes it, and scored P("yes") of the two-way softmax that llama.cpp
    computes on its `cls.output` rows, against transformers' causal LM on the same tokens."""
    config = TINY_CONFIGS["qwen3"]()
    config.tie_word_embeddings = True
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        hf.get_output_embeddings().weight[-2:].normal_(0, 0.2)
    save_tiny_tokenizer(tmp_path, config.vocab_size, special=("no", "yes"))
    no, yes = config.vocab_size - 2, config.vocab_size - 1
    path = write_reranker_gguf(tmp_path, hf, no, yes)
    llm = LLM(str(path), show_progress=False, device="cpu", num_kv_blocks=64, block_size=4)
    assert type(llm.engine.loaded.model).__name__ == "Qwen3ForSequenceClassification"
    assert llm.engine.classifier_labels == ["yes"]
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    for out, doc in zip(outs, DOCS, strict=True):
        text = RERANK_TEMPLATE.replace("{query}", QUERY).replace("{document}", doc)
        assert out.prompt_token_ids == text_ids(tmp_path, text)  # no BOS added, none needed
        logits = hf_last_logits(hf, out.prompt_token_ids)
        assert out.score == pytest.approx(torch.softmax(logits[[yes, no]], dim=0)[0].item(), abs=1e-4)
    assert max(o.score for o in outs) - min(o.score for o in outs) > 0.01
    # truncation shortens the document, never the template around it
    (cut,) = llm.score(QUERY, DOCS[3] * 4, use_tqdm=False, truncate_prompt_tokens=60)
    assert 55 <= len(cut.prompt_token_ids) <= 60
    assert cut.prompt_token_ids[-len(text_ids(tmp_path, "\nAnswer: ")) :] == text_ids(tmp_path, "\nAnswer: ")


def test_a_rerank_template_given_as_an_override_formats_each_pair(tmp_path):
    """`rerank_template` (what a Qwen3-Reranker GGUF carries) given through `hf_overrides` to an
    HF folder: each pair is written into it, as llama-server writes a GGUF's, and scored there."""
    config = TINY_CONFIGS["qwen3"]()
    torch.manual_seed(2)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path, config.vocab_size, special=("no", "yes"))
    no, yes = config.vocab_size - 2, config.vocab_size - 1
    llm = LLM(str(tmp_path), show_progress=False, device="cpu", num_kv_blocks=64, block_size=4,
              hf_overrides={**RERANKER, "rerank_template": RERANK_TEMPLATE})  # fmt: skip
    for out, doc in zip(llm.score(QUERY, DOCS[:2], use_tqdm=False), DOCS[:2], strict=True):
        text = RERANK_TEMPLATE.replace("{query}", QUERY).replace("{document}", doc)
        assert out.prompt_token_ids == text_ids(tmp_path, text)
        logits = hf_last_logits(hf, out.prompt_token_ids)
        assert out.score == pytest.approx(torch.softmax(logits[[no, yes]], dim=0)[1].item(), abs=1e-5)
