"""`/v1/score` and `/v1/rerank` (and their other paths) on an app in this process serving two
tiny BERTs: a cross-encoder, whose scores are compared with transformers' (sigmoid of the
one-label logit), and a sentence-transformers embedding model (mean pooling), whose scores are the
cosine of transformers' pooled hidden states; the response shapes vLLM gives; bad requests as
OpenAI-shaped 400s while the server keeps serving."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from tests.models.test_cross_encoder import CONFIG, save_cross_encoder, write_tokenizer

pytestmark = pytest.mark.e2e

QUERY = "w3 w17 w5"
DOCS = ["w3 w4", "w17 w90 w91 w92 w93", "w5", "w60 w3 w17 w5 w61"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    ce = tmp_path_factory.mktemp("cross-encoder")
    ce_model = save_cross_encoder(ce)
    emb = tmp_path_factory.mktemp("bi-encoder")
    torch.manual_seed(3)
    emb_model = transformers.BertModel(transformers.BertConfig(**CONFIG)).eval()
    emb_model.save_pretrained(emb)
    write_tokenizer(emb)
    # sentence-transformers' files: mean pooling, then Normalize
    (emb / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))  # fmt: skip
    (emb / "1_Pooling").mkdir()
    (emb / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    cls = tmp_path_factory.mktemp("classifier")
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    cls_model = save_cross_encoder(
        cls, seed=9, num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()}
    )
    return {"ce": (ce, ce_model), "emb": (emb, emb_model), "cls": (cls, cls_model)}


@pytest.fixture(scope="module")
def client(folders) -> Iterator:
    from fastapi.testclient import TestClient

    from llmserve.config import ServerConfig
    from llmserve.config.models import ModelSpec
    from llmserve.server.app import build_app

    specs = [ModelSpec(name, str(folders[name][0])) for name in ("ce", "emb", "cls")]
    with TestClient(build_app(specs, ServerConfig())) as c:
        yield c


def cross_encoder_scores(folders, pairs: list[tuple[str, str]]) -> list[float]:
    folder, hf = folders["ce"]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    enc = tok([a for a, _ in pairs], [b for _, b in pairs], return_tensors="pt", padding=True)
    with torch.no_grad():
        return hf(**enc).logits[:, 0].sigmoid().tolist()


def cosine_scores(folders, pairs: list[tuple[str, str]]) -> list[float]:
    folder, hf = folders["emb"]
    tok = transformers.AutoTokenizer.from_pretrained(folder)

    def vector(text: str) -> torch.Tensor:
        with torch.no_grad():
            return hf(**tok(text, return_tensors="pt")).last_hidden_state[0].mean(0)

    return [torch.nn.functional.cosine_similarity(vector(a), vector(b), dim=0).item() for a, b in pairs]


def num_tokens(folders, model: str, texts: list[str | tuple[str, str]]) -> int:
    tok = transformers.AutoTokenizer.from_pretrained(folders[model][0])
    return sum(len(tok(*t)["input_ids"]) if isinstance(t, tuple) else len(tok(t)["input_ids"]) for t in texts)


@pytest.mark.parametrize("path", ["/v1/score", "/score"])
@pytest.mark.parametrize("model", ["ce", "emb"])
def test_score_one_against_many(client, folders, path, model):
    body = client.post(path, json={"model": model, "text_1": QUERY, "text_2": DOCS}).json()
    pairs = [(QUERY, d) for d in DOCS]
    ref = cross_encoder_scores(folders, pairs) if model == "ce" else cosine_scores(folders, pairs)
    assert body["object"] == "list" and body["model"] == model and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    assert all(d["object"] == "score" for d in body["data"])
    assert [d["score"] for d in body["data"]] == pytest.approx(ref, abs=1e-5)
    # what the model read: each pair once (cross-encoder), or each distinct text once
    expected = num_tokens(folders, model, pairs if model == "ce" else [QUERY, *DOCS])
    assert body["usage"] == {"prompt_tokens": expected, "total_tokens": expected, "completion_tokens": 0}


def test_score_side_by_side(client, folders):
    text_1, text_2 = ["w1 w2", "w7"], ["w2 w1", "w8 w9"]
    body = client.post("/v1/score", json={"model": "ce", "text_1": text_1, "text_2": text_2}).json()
    ref = cross_encoder_scores(folders, list(zip(text_1, text_2, strict=True)))
    assert [d["score"] for d in body["data"]] == pytest.approx(ref, abs=1e-5)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank", "/reranking", "/v1/reranking"])
@pytest.mark.parametrize("model", ["ce", "emb"])
def test_rerank_orders_documents_by_relevance(client, folders, path, model):
    pairs = [(QUERY, d) for d in DOCS]
    ref = cross_encoder_scores(folders, pairs) if model == "ce" else cosine_scores(folders, pairs)
    order = sorted(range(len(DOCS)), key=lambda i: -ref[i])
    body = client.post(path, json={"model": model, "query": QUERY, "documents": DOCS, "top_n": 3}).json()
    assert body["id"].startswith("rerank-") and body["model"] == model
    assert [r["index"] for r in body["results"]] == order[:3]
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx(
        [ref[i] for i in order[:3]], abs=1e-5
    )
    assert [r["document"] for r in body["results"]] == [{"text": DOCS[i]} for i in order[:3]]
    assert body["usage"]["total_tokens"] == num_tokens(
        folders, model, pairs if model == "ce" else [QUERY, *DOCS]
    )


def test_rerank_takes_document_objects_and_can_leave_the_documents_out(client, folders):
    docs = [{"text": d} for d in DOCS[:2]]
    body = client.post(
        "/v1/rerank", json={"model": "ce", "query": QUERY, "documents": docs, "return_documents": False}
    ).json()
    assert sorted(r["index"] for r in body["results"]) == [0, 1]  # top_n absent: all of them
    assert all("document" not in r for r in body["results"])


@pytest.mark.parametrize(
    ("path", "body", "param", "match"),
    [
        (
            "/v1/score",
            {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]},
            "text_2",
            "text_1 has 2 texts and text_2 3",
        ),
        ("/v1/score", {"text_1": [], "text_2": "c"}, "text_1", "text_1 must not be empty"),
        ("/v1/score", {"text_1": "a", "text_2": 3}, "text_2", "text_2"),
        (
            "/v1/score",
            {"text_1": "a", "text_2": ["w1", " ".join(["w9"] * 70)]},
            "text_2",
            r"pair 1 .*exceeds",
        ),
        ("/v1/rerank", {"query": "a", "documents": []}, "documents", "documents must not be empty"),
        ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n", "top_n must be >= 0"),
        ("/v1/rerank", {"documents": ["b"]}, "query", "query"),
    ],
)
def test_bad_requests_are_400s_and_the_server_keeps_serving(client, path, body, param, match):
    r = client.post(path, json={"model": "ce", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert __import__("re").search(match, error["message"]), error["message"]
    assert client.post("/v1/score", json={"model": "ce", "text_1": "w1", "text_2": "w2"}).status_code == 200


@pytest.mark.parametrize("model", ["ce", "emb"])
def test_truncate_prompt_tokens_cuts_what_the_context_cannot_hold(client, folders, model):
    """A document over the context is a 400 unless truncate_prompt_tokens cuts it (-1: the
    context; k: k tokens), and scores what transformers scores for the truncated inputs; a bad
    value is a 400 naming the field."""
    long_doc = " ".join(f"w{10 + i % 90}" for i in range(100))
    body = {"model": model, "query": QUERY, "documents": [long_doc, DOCS[0]]}
    r = client.post("/v1/rerank", json=body)
    assert r.status_code == 400 and "exceeds" in r.json()["error"]["message"]
    for k in (-1, 20):
        got = client.post("/v1/rerank", json={**body, "truncate_prompt_tokens": k}).json()
        limit = 64 if k == -1 else k
        folder, hf = folders[model]
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        with torch.no_grad():
            if model == "ce":
                enc = tok([QUERY] * 2, [long_doc, DOCS[0]], truncation="longest_first", max_length=limit,
                          padding=True, return_tensors="pt")  # fmt: skip
                ref = hf(**enc).logits[:, 0].sigmoid().tolist()
            else:
                vectors = [hf(**tok(t, truncation=True, max_length=limit, return_tensors="pt")).last_hidden_state[0].mean(0)
                           for t in (QUERY, long_doc, DOCS[0])]  # fmt: skip
                ref = [
                    torch.nn.functional.cosine_similarity(vectors[0], v, dim=0).item() for v in vectors[1:]
                ]
        assert {r["index"]: r["relevance_score"] for r in got["results"]} == pytest.approx(
            dict(enumerate(ref)), abs=1e-5
        )
    for bad in (0, -5):
        r = client.post(
            "/v1/score", json={"model": model, "text_1": "w1", "text_2": "w2", "truncate_prompt_tokens": bad}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize("path", ["/classify", "/v1/classify"])
def test_classify_gives_each_inputs_label_probabilities(client, folders, path):
    """vLLM's /classify on a three-label classifier: softmax probabilities as transformers gives
    them, the label id2label names for the largest, texts and token ids alike; usage counts the
    tokens; a model that is no classifier, and a bad input, are 400s."""
    folder, hf = folders["cls"]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    texts = ["w3 w17 w5", "w60 w61 w62"]
    body = client.post(path, json={"model": "cls", "input": [*texts, texts[0]]}).json()
    assert body["object"] == "list" and body["id"].startswith("classify-") and body["model"] == "cls"
    with torch.no_grad():
        ref = hf(**tok(texts, return_tensors="pt", padding=True)).logits.softmax(-1).tolist()
    ref.append(ref[0])
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and all(
        d["num_classes"] == 3 for d in body["data"]
    )
    for d, r in zip(body["data"], ref, strict=True):
        assert d["probs"] == pytest.approx(r, abs=1e-5)
        assert d["label"] == ["negative", "neutral", "positive"][max(range(3), key=r.__getitem__)]
    n = 2 * len(tok(texts[0])["input_ids"]) + len(tok(texts[1])["input_ids"])
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}
    single = client.post(path, json={"model": "cls", "input": texts[1]}).json()
    assert single["data"][0]["probs"] == pytest.approx(ref[1], abs=1e-5)
    ids = client.post(path, json={"model": "cls", "input": [tok(texts[0])["input_ids"]]}).json()
    assert ids["data"][0]["probs"] == pytest.approx(ref[0], abs=1e-5)
    for bad, param in (({"model": "emb", "input": "w1"}, "model"), ({"model": "cls", "input": []}, "input"),
                       ({"model": "cls", "input": [[10**6]]}, "input")):  # fmt: skip
        r = client.post(path, json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = client.post("/v1/score", json={"model": "cls", "text_1": "w1", "text_2": "w2"})
    assert r.status_code == 400 and "/classify" in r.json()["error"]["message"]


def test_pooling_gives_each_models_own_output(client, folders):
    """vLLM's /pooling, one route for every pooling model: the embedding model's embeddings (as
    /v1/embeddings gives them, base64 too), the classifier's label probabilities (as /classify),
    the cross-encoder's score for a text (its head on one input); bad fields are 400s."""
    texts = ["w3 w17 w5", "w60 w61 w62"]
    body = client.post("/pooling", json={"model": "emb", "input": texts}).json()
    assert body["object"] == "list" and body["id"].startswith("pool-") and body["model"] == "emb"
    assert [d["object"] for d in body["data"]] == ["pooling", "pooling"]
    embedded = client.post("/v1/embeddings", json={"model": "emb", "input": texts}).json()
    for d, e in zip(body["data"], embedded["data"], strict=True):
        assert d["data"] == pytest.approx(e["embedding"], abs=1e-6)
    assert body["usage"]["prompt_tokens"] == embedded["usage"]["prompt_tokens"] > 0
    b64 = client.post(
        "/pooling", json={"model": "emb", "input": texts[0], "encoding_format": "base64"}
    ).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["data"]), dtype="<f4")
    assert decoded.tolist() == pytest.approx(embedded["data"][0]["embedding"], abs=1e-6)
    classified = client.post("/classify", json={"model": "cls", "input": texts}).json()
    pooled = client.post("/pooling", json={"model": "cls", "input": texts}).json()
    assert [d["data"] for d in pooled["data"]] == [c["probs"] for c in classified["data"]]
    score = client.post("/pooling", json={"model": "ce", "input": texts[0]}).json()["data"][0]["data"]
    ce = client.post("/classify", json={"model": "ce", "input": texts[0]}).json()["data"][0]["probs"]
    assert len(score) == 1 and score == ce and 0.0 < score[0] < 1.0  # the one-label head's sigmoid
    for bad, param in (({"model": "cls", "input": "w1", "dimensions": 4}, "dimensions"),
                       ({"model": "emb", "input": []}, "input"),
                       ({"model": "emb", "input": "w1", "dimensions": 0}, "dimensions")):  # fmt: skip
        r = client.post("/pooling", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_cross_encoder_refuses_embeddings_and_chat_with_the_route_to_use(client):
    r = client.post("/v1/embeddings", json={"model": "ce", "input": "w1"})
    assert r.status_code == 400 and "/v1/rerank" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "model"
    r = client.post("/v1/completions", json={"model": "ce", "prompt": "w1", "max_tokens": 2})
    assert r.status_code == 400 and "cross-encoder" in r.json()["error"]["message"]


def test_run_batch_scores_and_reranks_as_the_server_does(client, folders, tmp_path):
    """`llmserve run-batch` with /v1/score and /v1/rerank lines: each line's body is the served one
    (ids and timestamps aside), and a bad line is that line's own 400."""
    import subprocess
    import sys

    lines = [
        {"custom_id": "s", "url": "/v1/score", "body": {"model": "ce", "text_1": QUERY, "text_2": DOCS}},
        {"custom_id": "r", "url": "/v1/rerank", "body": {"model": "ce", "query": QUERY, "documents": DOCS}},
        {"custom_id": "bad", "url": "/v1/rerank", "body": {"model": "ce", "query": QUERY, "documents": []}},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    cmd = [sys.executable, "-m", "llmserve.cli.main", "--log-level", "WARNING", "run-batch",
           "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--model", str(folders["ce"][0]),
           "--served-model-name", "ce"]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    out = {
        x["custom_id"]: x["response"]
        for x in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())
    }

    def comparable(body: dict) -> dict:
        return {k: v for k, v in body.items() if k not in ("id", "created")}

    for line in lines[:2]:
        served = client.post(line["url"], json=line["body"]).json()
        assert out[line["custom_id"]]["status_code"] == 200
        got = comparable(out[line["custom_id"]]["body"])
        assert got.keys() == comparable(served).keys()
        for key in ("usage", "model"):
            assert got[key] == served[key]
    scores = [d["score"] for d in out["s"]["body"]["data"]]
    assert scores == pytest.approx(cross_encoder_scores(folders, [(QUERY, d) for d in DOCS]), abs=1e-5)
    assert [r["index"] for r in out["r"]["body"]["results"]] == sorted(range(4), key=lambda i: -scores[i])
    assert out["bad"]["status_code"] == 400 and out["bad"]["body"]["error"]["param"] == "documents"
