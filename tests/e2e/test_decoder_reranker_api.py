"""The original Qwen3-Reranker's layout (a causal LM) served as a reranker with vLLM's command line,
`llmserve serve FOLDER --hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"],
"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'`: `/v1/rerank` orders
the documents by transformers' P("yes"), `/v1/score` gives the same scores, generation is a 400
naming the routes to use, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
import transformers

from tests.e2e.conftest import MODEL_NAME, ServerProcess
from tests.models.test_decoder_classifier import DOCS, QUERY, RERANKER, hf_last_logits, pair_ids
from tests.models.tiny import TINY_CONFIGS, save_tiny_tokenizer

pytestmark = pytest.mark.e2e


def test_the_original_qwen3_reranker_serves_rerank_and_score(tmp_path):
    config = TINY_CONFIGS["qwen3"]()
    torch.manual_seed(11)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # spread the two rows' logits apart (see test_decoder_classifier.py)
        hf.get_output_embeddings().weight[-2:].normal_(0, 0.2)
    hf.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path, config.vocab_size, special=("no", "yes"))
    no, yes = config.vocab_size - 2, config.vocab_size - 1
    ref = []
    for doc in DOCS:
        logits = hf_last_logits(hf, pair_ids(tmp_path, QUERY, doc))
        ref.append(torch.softmax(logits[[no, yes]], dim=0)[1].item())
    order = sorted(range(len(DOCS)), key=lambda i: -ref[i])

    server = ServerProcess(tmp_path, "--hf-overrides", json.dumps(RERANKER)).start()
    try:
        body = httpx.post(
            f"{server.url}/v1/rerank",
            json={"model": MODEL_NAME, "query": QUERY, "documents": DOCS},
            timeout=60,
        ).json()
        assert [r["index"] for r in body["results"]] == order
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx(
            [ref[i] for i in order], abs=1e-5
        )
        body = httpx.post(
            f"{server.url}/v1/score", json={"model": MODEL_NAME, "text_1": QUERY, "text_2": DOCS}, timeout=60
        ).json()
        assert [d["score"] for d in body["data"]] == pytest.approx(ref, abs=1e-5)
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 400 and "is a cross-encoder" in r.json()["error"]["message"]
        assert "/v1/rerank" in r.json()["error"]["message"]
        again = httpx.post(
            f"{server.url}/v1/score",
            json={"model": MODEL_NAME, "text_1": QUERY, "text_2": DOCS[:1]},
            timeout=60,
        ).json()
        assert again["data"][0]["score"] == pytest.approx(ref[0], abs=1e-5)
    finally:
        server.stop()
