"""`/v1/embeddings` through the `openai` client and `/api/embed` (and `/api/embeddings`) through
the `ollama` client, on the tiny model with a server started with `--pooling mean`: vectors
against transformers' final hidden states pooled the same way, every `input` form, base64,
`dimensions`, usage, and bad requests in each API's error shape."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import ollama
import openai
import pytest
import torch
import transformers

from tests.e2e.conftest import MODEL_NAME, ServerProcess

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def mean_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_model_dir, "--pooling", "mean", "--max-model-len", "128").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(tiny_model_dir / "tokenizer.json"))


def reference(hf, ids: list[int], dimensions: int | None = None) -> torch.Tensor:
    with torch.no_grad():
        v = hf.model(torch.tensor([ids])).last_hidden_state[0].mean(0)
    return torch.nn.functional.normalize(v[:dimensions] if dimensions else v, dim=0)


def assert_matches(vector: list[float], ref: torch.Tensor) -> None:
    got = torch.tensor(vector)
    assert got.shape == ref.shape
    assert torch.nn.functional.cosine_similarity(got, ref, dim=0) >= 0.9999


TEXTS = ["The quick brown fox", "jumps over the lazy dog. 0123456789", "naïve café"]


@pytest.mark.parametrize("encoding_format", ["float", "base64", None])
def test_openai_strings_match_transformers(mean_server, hf, tokenizer, encoding_format):
    """float: a list; base64 asked for: the string (little-endian float32); not given: the
    client asks for base64 itself and decodes it."""
    client = mean_server.client()
    kwargs = {"encoding_format": encoding_format} if encoding_format else {}
    r = client.embeddings.create(model=MODEL_NAME, input=TEXTS, **kwargs)
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == MODEL_NAME
    for d, x in zip(r.data, ids, strict=True):
        vector = d.embedding
        if encoding_format == "base64":
            assert isinstance(vector, str)
            vector = np.frombuffer(base64.b64decode(vector), dtype="<f4").tolist()
        assert_matches(vector, reference(hf, x))
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))


def test_openai_token_ids_single_and_lists_and_dimensions(mean_server, hf):
    client = mean_server.client()
    one = [5, 17, 99, 3]
    r = client.embeddings.create(model=MODEL_NAME, input=one)
    assert len(r.data) == 1 and r.usage.prompt_tokens == 4
    assert_matches(r.data[0].embedding, reference(hf, one))
    batch = [one, list(range(100, 200))]  # the second is pooled over several prefill chunks
    r = client.embeddings.create(model=MODEL_NAME, input=batch, dimensions=16)
    for d, x in zip(r.data, batch, strict=True):
        assert len(d.embedding) == 16
        assert_matches(d.embedding, reference(hf, x, 16))


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"input": []}, "input must not be empty"),
        ({"input": [[1] * 129]}, "input: input of 129 tokens exceeds"),
        ({"input": [[1, 2], [1] * 200]}, r"input\[1\]: input of 200 tokens"),
        ({"input": "hi", "dimensions": 65}, "dimensions must be between 1 and"),
        ({"input": "hi", "dimensions": 0}, "dimensions must be >= 1"),
        ({"input": [[999999]]}, "outside the vocabulary"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_openai_bad_requests(mean_server, body, match):
    with pytest.raises(openai.BadRequestError, match=match):
        mean_server.client().embeddings.create(model=MODEL_NAME, **body)


def test_generation_still_answers_beside_embeddings(mean_server):
    """A completion and an embedding request in flight together both complete."""
    import concurrent.futures

    client = mean_server.client()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        gen = pool.submit(
            client.completions.create, model=MODEL_NAME, prompt="The", max_tokens=16, temperature=0
        )
        emb = pool.submit(client.embeddings.create, model=MODEL_NAME, input=TEXTS * 4)
        assert len(emb.result().data) == 12
        assert gen.result().usage.completion_tokens == 16
    stats = httpx.get(f"{mean_server.url}/stats").json()
    assert stats["kv_blocks_used"] == 0


def prompt_tokens_total(server: ServerProcess) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("llmserve:prompt_tokens_total")
    )


def test_embedding_prompt_tokens_are_counted_in_metrics(mean_server):
    before = prompt_tokens_total(mean_server)
    r = mean_server.client().embeddings.create(model=MODEL_NAME, input=[[5, 6, 7], [8, 9]])
    assert r.usage.prompt_tokens == 5
    assert prompt_tokens_total(mean_server) - before == 5


def test_ollama_embed(mean_server, hf, tokenizer):
    client = ollama.Client(host=mean_server.url)
    r = client.embed(model=MODEL_NAME, input=TEXTS)
    assert len(r.embeddings) == 3 and r.prompt_eval_count == sum(len(tokenizer.encode(t)) for t in TEXTS)
    for v, t in zip(r.embeddings, TEXTS, strict=True):
        assert_matches(v, reference(hf, tokenizer.encode(t)))
    one = client.embed(model=MODEL_NAME, input=TEXTS[0], dimensions=8)
    assert_matches(one.embeddings[0], reference(hf, tokenizer.encode(TEXTS[0]), 8))
    legacy = client.embeddings(model=MODEL_NAME, prompt=TEXTS[0])
    assert_matches(legacy.embedding, reference(hf, tokenizer.encode(TEXTS[0])))


def test_ollama_truncate(mean_server, hf, tokenizer):
    long = "The quick brown fox jumps over the lazy dog. " * 40  # > 128 tokens
    ids = tokenizer.encode(long)
    assert len(ids) > 128
    r = ollama.Client(host=mean_server.url).embed(model=MODEL_NAME, input=long)
    assert r.prompt_eval_count == 128
    assert_matches(r.embeddings[0], reference(hf, ids[:128]))
    resp = httpx.post(
        f"{mean_server.url}/api/embed", json={"model": MODEL_NAME, "input": long, "truncate": False}
    )
    assert resp.status_code == 400 and "exceeds the model's context" in resp.json()["error"]
