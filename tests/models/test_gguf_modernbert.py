"""ModernBERT in GGUF (llama.cpp's `modern-bert`: modernbert-embed, granite-embedding R2): a tiny
random ModernBERT with a byte-level BPE vocabulary and ModernBERT's `[CLS] text [SEP]` template,
written as llama.cpp's converter writes it (tensor names from the gguf package's map, the window,
the global-layer period, the two RoPE bases, a `gpt2` vocabulary), then embedded: the HF
tokenizer's ids and transformers' `ModernBertModel` vectors, pooled as the file says."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
import transformers
from tokenizers import processors

from llmserve import LLM
from tests.gguf_writer import add_bpe_vocab, add_encoder_metadata, convert_state_dict, hf_vocab, write_gguf
from tests.models.test_gguf_roberta import check_mean_embeddings, check_pair_scores, save_bpe_tokenizer

SPECIAL = ["<|endoftext|>", "[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
TEXTS = ["The quick brown fox", "jumps over the lazy dog. 0123456789 " * 3, "naïve café", "fox"]


def save_modernbert(folder: Path, reranker: bool = False) -> transformers.PreTrainedModel:
    """`reranker`: a `ModernBertForSequenceClassification` of one label, mean-pooled (as
    gte-reranker-modernbert-base), instead of the encoder alone."""
    vocab_size = save_bpe_tokenizer(folder, SPECIAL, processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    ))  # fmt: skip
    config = transformers.ModernBertConfig(
        vocab_size=vocab_size, hidden_size=48, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=128, local_attention=6, global_attn_every_n_layers=3,
        initializer_range=0.2, pad_token_id=4, cls_token_id=2, sep_token_id=3, bos_token_id=2, eos_token_id=3,
    )  # fmt: skip
    torch.manual_seed(0)
    if reranker:
        config.num_labels, config.classifier_pooling = 1, "mean"
        hf = transformers.ModernBertForSequenceClassification(config).eval()
    else:
        hf = transformers.ModernBertModel(config).eval()
    with torch.no_grad():  # LayerNorms away from 1, so a missing weight shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    hf.save_pretrained(folder)
    return hf


def write_modernbert_gguf(folder: Path, hf: transformers.ModernBertModel) -> Path:
    config = hf.config
    # the converter drops `model.` and names the classifier `classifier.out_proj` (-> cls.output)
    state = {
        k.removeprefix("model.").replace("classifier.", "classifier.out_proj."): v
        for k, v in hf.state_dict().items()
    }
    tensors = convert_state_dict("modern-bert", config, state)
    vocab = hf_vocab(folder)
    rope = config.rope_parameters

    def metadata(w: gguf.GGUFWriter) -> None:
        config.layer_norm_eps = config.norm_eps  # (the writer's name for it)
        add_encoder_metadata(w, config, config.max_position_embeddings, gguf.PoolingType.MEAN)
        w.kv_data[0].pop(f"{w.arch}.attention.layer_norm_epsilon")  # the converter's key for it:
        w.add_layer_norm_rms_eps(config.norm_eps)
        add_bpe_vocab(w, vocab, "gpt-2")
        w.add_sliding_window(config.local_attention)
        w.add_sliding_window_pattern(3)
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_key_value(
            f"{w.arch}.rope.freq_base_swa",
            rope["sliding_attention"]["rope_theta"],
            gguf.GGUFValueType.FLOAT32,
        )
        w.add_bos_token_id(2)
        w.add_eos_token_id(3)
        w.add_sep_token_id(3)
        w.add_pad_token_id(4)
        w.kv_data[0].pop("tokenizer.ggml.add_bos_token")  # the converter's flags for ModernBERT
        w.add_add_bos_token(True)
        w.add_add_eos_token(True)
        w.add_add_sep_token(True)

    (path,) = write_gguf(folder / "modernbert.gguf", "modern-bert", dict(tensors), metadata)
    return path


@pytest.fixture(scope="module")
def modernbert(tmp_path_factory) -> tuple[Path, transformers.ModernBertModel, LLM]:
    folder = tmp_path_factory.mktemp("modernbert-gguf")
    hf = save_modernbert(folder)
    return folder, hf, LLM(str(write_modernbert_gguf(folder, hf)), show_progress=False, device="cpu")


def test_ids_and_embeddings_match_the_hf_model(modernbert):
    """[CLS] text [SEP] as the HF tokenizer writes it; mean-pooled final states against transformers'
    (the longer text spans the window of 6, so the windowed layers are checked)."""
    assert type(modernbert[2].engine.loaded.model).__name__ == "ModernBertModel"
    check_mean_embeddings(*modernbert, TEXTS)


def test_a_modernbert_reranker_gguf_scores_pairs_as_transformers(tmp_path):
    """gte-reranker-modernbert-base's layout in GGUF (`cls`, `cls.norm`, `cls.output`: the head and
    the classifier; no `classifier.pooling_type`, which llama.cpp reads as mean): each pair as
    `[CLS] query [SEP] document [SEP]`, scored with the sigmoid of transformers' logit."""
    hf = save_modernbert(tmp_path, reranker=True)
    llm = LLM(str(write_modernbert_gguf(tmp_path, hf)), show_progress=False, device="cpu")
    assert llm.engine.default_pooling.pooling == "mean"
    check_pair_scores(tmp_path, hf, llm, TEXTS[0], TEXTS[1:])
