"""ModernBERT (models/modernbert.py) against transformers on tiny random configs: the encoder's
hidden states (global and windowed layers, two RoPE bases, GeGLU, bias-free and biased variants)
over a flat batch of sequences longer than the window, embeddings pooled by the engine, and
`ModernBertForSequenceClassification` as a reranker (`LLM.score`, one label, first-token or mean
pooling) and as a classifier of texts (`LLM.classify`, three labels)."""

from __future__ import annotations

import pytest
import torch
import transformers

from llmserve import LLM, PoolingParams
from llmserve.config import ModelConfig
from llmserve.layers.attention.encoder import EncoderMetadata
from llmserve.model_executor.model_loader import load_model
from tests.models.test_cross_encoder import CONFIG as BERT_CONFIG
from tests.models.test_cross_encoder import DOCS, QUERY, write_tokenizer

CONFIG = dict(
    vocab_size=BERT_CONFIG["vocab_size"], hidden_size=48, num_hidden_layers=4, num_attention_heads=4,
    intermediate_size=64, max_position_embeddings=128, local_attention=6, global_attn_every_n_layers=3,
    initializer_range=0.2, pad_token_id=0, cls_token_id=2, sep_token_id=3, bos_token_id=2, eos_token_id=3,
)  # fmt: skip
BIASED = dict(attention_bias=True, mlp_bias=True, norm_bias=True, classifier_bias=True)
PROMPTS = [[2, 7, 8, 9, 3], [2, 5, 3], list(range(10, 50)), [2, *range(60, 75), 3]]
LABELS = {0: "neg", 1: "neutral", 2: "pos"}


def save(folder, cls=transformers.ModernBertModel, seed: int = 0, **config) -> torch.nn.Module:
    torch.manual_seed(seed)
    hf = cls(transformers.ModernBertConfig(**{**CONFIG, **config})).eval()
    with torch.no_grad():  # LayerNorms away from (1, 0), so a missing weight or bias shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    hf.save_pretrained(folder)
    write_tokenizer(folder)
    return hf


@pytest.mark.parametrize("extra", [{}, BIASED], ids=["no-bias", "biased"])
def test_hidden_states_match_transformers_batched(tmp_path, extra):
    hf = save(tmp_path, **extra)
    assert hf.config.layer_types == [
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ]
    loaded = load_model(ModelConfig(str(tmp_path), device="cpu", show_progress=False))
    lens = [len(p) for p in PROMPTS]
    md = EncoderMetadata.build(lens, torch.device("cpu"))
    ids = torch.tensor([t for p in PROMPTS for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        hidden = loaded.model(ids, positions, md)
        start = 0
        for p in PROMPTS:
            ref = hf(torch.tensor([p])).last_hidden_state[0]
            torch.testing.assert_close(hidden[start : start + len(p)], ref, rtol=1e-4, atol=1e-4)
            start += len(p)
        # the window matters: the long prompt's states differ with every layer global
        full = hf.config.to_dict() | {"layer_types": ["full_attention"] * 4}
        other = transformers.ModernBertModel(transformers.ModernBertConfig(**full)).eval()
        other.load_state_dict(hf.state_dict())
        assert (other(torch.tensor([PROMPTS[2]])).last_hidden_state[0] - hidden[8:48]).abs().max() > 1e-2


def test_embeddings_pool_the_final_states(tmp_path):
    hf = save(tmp_path)
    llm = LLM(str(tmp_path), show_progress=False, device="cpu")
    outs = llm.embed(PROMPTS, PoolingParams("mean", normalize=False), use_tqdm=False)
    with torch.no_grad():
        for out, p in zip(outs, PROMPTS, strict=True):
            ref = hf(torch.tensor([p])).last_hidden_state[0].mean(0)
            torch.testing.assert_close(torch.tensor(out.embedding), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_a_reranker_scores_pairs_as_transformers(tmp_path, pooling):
    hf = save(tmp_path, transformers.ModernBertForSequenceClassification, num_labels=1,
              classifier_pooling=pooling, **BIASED)  # fmt: skip
    llm = LLM(str(tmp_path), show_progress=False, device="cpu")
    assert llm.engine.default_pooling.pooling == pooling
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    enc = tok([QUERY] * len(DOCS), DOCS, return_tensors="pt", padding=True)
    with torch.no_grad():
        ref = hf(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits[:, 0].sigmoid()
    torch.testing.assert_close(torch.tensor([o.score for o in outs]), ref, rtol=1e-5, atol=1e-5)
    other = "mean" if pooling == "cls" else "cls"
    with pytest.raises(ValueError, match=f"pooling must be 'auto' or '{pooling}'"):
        LLM(str(tmp_path), show_progress=False, device="cpu", pooling=other)


def test_a_classifier_of_three_labels_matches_transformers(tmp_path):
    hf = save(tmp_path, transformers.ModernBertForSequenceClassification, seed=3, num_labels=3,
              id2label=LABELS, label2id={v: k for k, v in LABELS.items()})  # fmt: skip
    llm = LLM(str(tmp_path), show_progress=False, device="cpu")
    texts = ["w3 w17 w5", "w60 w61", "w1 " * 20]
    outs = llm.classify(texts, use_tqdm=False)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    enc = tok(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        ref = hf(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits.softmax(-1)
    torch.testing.assert_close(torch.tensor([o.probs for o in outs]), ref, rtol=1e-5, atol=1e-5)
    assert [o.label for o in outs] == [LABELS[int(i)] for i in ref.argmax(-1)]
