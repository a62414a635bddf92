"""Ollama's API through the `ollama` Python client (PyPI) as a real client, on the tiny model:
generate and chat, streamed (NDJSON) and not, list/ps/show/version, options mapped to sampling
parameters (checked against the OpenAI endpoint's output for the same settings), `format` as JSON,
and errors in Ollama's `{"error": ...}` shape."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import ollama
import pytest
import torch

from tests.e2e.conftest import MODEL_NAME, ServerProcess

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0, "num_predict": 8, "repeat_penalty": 1.0, "top_k": 0, "top_p": 1.0}


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> ollama.Client:
    return ollama.Client(host=server.url)


def openai_text(server: ServerProcess, **body) -> str:
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL_NAME, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_generate_raw_matches_the_openai_endpoint(client: ollama.Client, server: ServerProcess) -> None:
    """Greedy options give the very text /v1/completions gives for the same prompt, whole and
    streamed; the final object carries Ollama's counts and the context."""
    expected = openai_text(server, prompt="The quick brown fox", max_tokens=8, temperature=0)
    r = client.generate(model=MODEL_NAME, prompt="The quick brown fox", raw=True, options=GREEDY)
    assert r.done and r.done_reason == "length" and r.response == expected
    assert r.eval_count == 8 and r.prompt_eval_count > 0 and r.total_duration > 0 and r.context
    parts = list(
        client.generate(model=MODEL_NAME, prompt="The quick brown fox", raw=True, options=GREEDY, stream=True)
    )
    assert [p.done for p in parts][-1] is True and not any(p.done for p in parts[:-1])
    assert "".join(p.response for p in parts) == expected
    assert parts[-1].eval_count == 8


def test_chat_whole_and_streamed(client: ollama.Client) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    whole = client.chat(model=MODEL_NAME, messages=messages, options=GREEDY)
    assert whole.message.role == "assistant" and whole.done and whole.eval_count == 8
    parts = list(client.chat(model=MODEL_NAME, messages=messages, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].done and parts[-1].done_reason == "length"
    # the ":latest" tag names the same model, as in Ollama
    again = client.chat(model=f"{MODEL_NAME}:latest", messages=messages, options=GREEDY)
    assert again.message.content == whole.message.content


def test_options_reach_the_sampler(client: ollama.Client) -> None:
    """A seed repeats a sampled reply; stop ends it at the stop string (excluded)."""
    opts = {"temperature": 1.0, "seed": 7, "num_predict": 12}
    a = client.generate(model=MODEL_NAME, prompt="Once", raw=True, options=opts).response
    b = client.generate(model=MODEL_NAME, prompt="Once", raw=True, options=opts).response
    assert a == b
    full = client.generate(
        model=MODEL_NAME, prompt="Once", raw=True, options={**GREEDY, "num_predict": 12}
    ).response
    stop = full[3:6]
    cut = client.generate(
        model=MODEL_NAME, prompt="Once", raw=True, options={**GREEDY, "num_predict": 12, "stop": [stop]}
    )
    assert cut.done_reason == "stop" and stop not in cut.response and full.startswith(cut.response)


def test_format_json(so_server: ServerProcess) -> None:
    """`format` as a schema constrains the reply (the server whose tiny model's EOS is not a quote)."""
    client = ollama.Client(host=so_server.url)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    for seed in range(3):
        r = client.generate(
            model=MODEL_NAME,
            prompt="JSON:",
            raw=True,
            format=schema,
            options={"num_predict": 40, "seed": seed},
        )
        assert r.done_reason == "stop" and isinstance(json.loads(r.response)["a"], int), r.response
    r = client.chat(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        format="json",
        options={"num_predict": 6, "seed": 0},
    )
    # "json" is any object: the random model opens one (and, unbounded, rarely closes it in 6 tokens)
    assert r.message.content.startswith("{"), r.message.content


def test_list_ps_show_version(client: ollama.Client, server: ServerProcess, tiny_model_dir: Path) -> None:
    """/api/tags' `size` is the weight files' bytes, as Ollama's clients read it (the size on
    disk), as is /v1/models'; /api/ps' `size` is what the loaded model takes (weights + KV cache,
    /v1/models' `memory_bytes`), `size_vram` the part of it on a GPU (none on the CPU)."""
    on_disk = sum(p.stat().st_size for p in tiny_model_dir.glob("*.safetensors"))
    listed = client.list().models
    assert [m.model for m in listed] == [MODEL_NAME] and listed[0].size == on_disk
    assert listed[0].details.family == "llama"
    (card,) = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert card["size"] == on_disk and card["memory_bytes"] > on_disk  # float32 weights + the KV cache
    (loaded,) = client.ps().models
    assert loaded.model == MODEL_NAME and loaded.size == card["memory_bytes"]
    assert loaded.size_vram == (loaded.size if torch.cuda.is_available() else 0)
    shown = client.show(MODEL_NAME)
    assert shown.details.family == "llama" and "im_start" in (shown.template or "")
    assert shown.modelinfo["llama.context_length"] == 256
    assert httpx.get(f"{client._client.base_url}/api/version").json()["version"]


def test_errors_are_ollama_shaped(client: ollama.Client, server: ServerProcess) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404 and "not found" in e.value.error
    for body, where in [
        ({"model": MODEL_NAME, "prompt": "x", "options": {"temperature": "hot"}}, "options.temperature"),
        ({"model": MODEL_NAME, "prompt": "x", "options": {"num_predict": 0}}, "num_predict"),
        ({"model": MODEL_NAME, "prompt": 5}, "prompt"),
        ({"prompt": "x"}, "model"),
        ({"model": MODEL_NAME, "prompt": "x", "think": "max"}, "think"),
        # a template without <think>: Ollama's answer to `think` for a model that does not think
        ({"model": MODEL_NAME, "prompt": "x", "think": True}, f'"{MODEL_NAME}" does not support thinking'),
    ]:
        r = httpx.post(f"{server.url}/api/generate", json=body, timeout=30)
        assert r.status_code == 400 and where in r.json()["error"], (body, r.text)
    r = httpx.post(f"{server.url}/api/chat", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    bad_tool = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "nope"}],
    }
    r = httpx.post(f"{server.url}/api/chat", json=bad_tool, timeout=30)
    assert r.status_code == 400 and "tools" in r.json()["error"], r.text
    with pytest.raises(ollama.ResponseError) as e:  # model management has no counterpart here
        client.pull(MODEL_NAME)
    assert e.value.status_code == 400 and "/api/pull is not supported" in e.value.error
    # unknown runtime options are ignored, as Ollama does
    ok = client.generate(
        model=MODEL_NAME,
        prompt="The quick brown fox",
        raw=True,
        options={**GREEDY, "num_ctx": 4096, "mirostat": 1},
    )
    plain = client.generate(model=MODEL_NAME, prompt="The quick brown fox", raw=True, options=GREEDY)
    assert ok.done and ok.response == plain.response and ok.eval_count == plain.eval_count
