"""LoRA adapters loaded and unloaded while the server runs (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter behind --allow-runtime-lora-updating and the API key), under traffic;
the Ollama routes naming adapters."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess

pytest.importorskip("peft")

KEY = "lora-key"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.models.test_lora import ALL, SOME, make_adapter

    root = tmp_path_factory.mktemp("lora-runtime")
    made = {
        "sql": make_adapter(tiny_model_dir, root / "sql", ALL, seed=1),
        "chat": make_adapter(tiny_model_dir, root / "chat", SOME, seed=2),
    }
    high = shutil.copytree(made["chat"], root / "rank-too-high")
    config = json.loads((high / "adapter_config.json").read_text())
    (high / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
    corrupt = shutil.copytree(made["chat"], root / "corrupt")
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    return {**made, "high": high, "corrupt": corrupt}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, adapters: dict[str, Path]) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        tiny_model_dir, "--enable-lora", "--lora-modules", f"sql={adapters['sql']}", "--max-cpu-loras", "4",
        "--allow-runtime-lora-updating", "--api-key", KEY,
    ).start()  # fmt: skip
    yield proc
    proc.stop()


def post(proc: ServerProcess, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{proc.url}{path}", json=body, headers=headers, timeout=60)


def complete(proc: ServerProcess, model: str, max_tokens: int = 8) -> str:
    out = proc.client(api_key=KEY).completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0
    )
    return out.choices[0].text


def test_load_serve_and_unload(server, adapters):
    sql = complete(server, "sql")
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "sql2", "lora_path": str(adapters["sql"])})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql2' added successfully."
    cards = {m.id: m for m in server.client(api_key=KEY).models.list().data}
    assert cards["sql2"].model_extra["parent"] == MODEL_NAME
    assert complete(server, "sql2") == sql  # the same folder: the same tokens (its own cache blocks)
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "sql2", "lora_path": str(adapters["chat"])})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "sql2"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql2' removed successfully."
    with pytest.raises(openai.NotFoundError):
        complete(server, "sql2")
    assert "sql2" not in {m.id for m in server.client(api_key=KEY).models.list().data}
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "sql2"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("adapter", "message"),
    [
        ("high", "adapter_config.json: rank 64 is above max_lora_rank 16"),
        ("corrupt", "adapter_model.safetensors: cannot read the LoRA adapter's tensors"),
        ("missing", "adapter_config.json: cannot read"),
    ],
)
def test_a_bad_adapter_is_a_400_and_the_server_serves_on(server, adapters, tmp_path, adapter, message):
    path = adapters.get(adapter, tmp_path / "nowhere")
    r = post(server, "/v1/load_lora_adapter", {"lora_name": f"bad-{adapter}", "lora_path": str(path)})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"] and str(path) in r.json()["error"]["message"]
    assert f"bad-{adapter}" not in {m.id for m in server.client(api_key=KEY).models.list().data}
    assert complete(server, MODEL_NAME)


def test_the_routes_need_the_key_and_a_good_body(server, adapters):
    body = {"lora_name": "x", "lora_path": str(adapters["chat"])}
    assert post(server, "/v1/load_lora_adapter", body, key=None).status_code == 401
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "x"}).status_code == 400
    r = post(server, "/v1/load_lora_adapter", {**body, "lora_name": MODEL_NAME})
    assert r.status_code == 400 and "served model's name" in r.text
    r = post(server, "/v1/load_lora_adapter", {**body, "base_model_name": "nope"})
    assert r.status_code == 404


def test_unloading_a_busy_adapter_lets_its_requests_finish(server, adapters):
    """vLLM's choice: an unload is immediate for new requests, and requests already running
    with the adapter finish with it (the engine drops its weights after the last one)."""
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "busy", "lora_path": str(adapters["chat"])})
    assert r.status_code == 200
    expected = complete(server, "busy", max_tokens=120)
    client = server.client(api_key=KEY)
    stream = client.completions.create(
        model="busy", prompt=PROMPT, max_tokens=120, temperature=0, stream=True
    )
    chunks = iter(stream)
    first = next(chunks).choices[0].text
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "busy"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(server, "busy")
    rest = "".join(c.choices[0].text for c in chunks if c.choices)
    assert first + rest == expected
    # loaded again under the same name: a new id, the same outputs
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "busy", "lora_path": str(adapters["chat"])})
    assert r.status_code == 200 and complete(server, "busy", max_tokens=120) == expected


def test_ollama_routes_name_adapters(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    tags = httpx.get(f"{server.url}/api/tags", headers=headers).json()["models"]
    sql = next(m for m in tags if m["name"] == "sql")
    assert sql["details"]["parent_model"] == MODEL_NAME
    show = httpx.post(f"{server.url}/api/show", json={"model": "sql"}, headers=headers).json()
    assert show["details"]["parent_model"] == MODEL_NAME and "ADAPTER " in show["modelfile"]
    r = httpx.post(
        f"{server.url}/api/generate",
        json={"model": "sql", "prompt": PROMPT, "raw": True, "stream": False,
              "options": {"temperature": 0, "num_predict": 8}},
        headers=headers, timeout=60,
    )  # fmt: skip
    assert r.status_code == 200 and r.json()["model"] == "sql"
    assert r.json()["response"] == complete(server, "sql")


def test_runtime_updating_is_off_by_default(tiny_model_dir, adapters):
    proc = ServerProcess(tiny_model_dir, "--enable-lora").start()
    try:
        r = post(
            proc, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["sql"])}, key=None
        )
        assert r.status_code == 404 and "--allow-runtime-lora-updating" in r.text
    finally:
        proc.stop()


def test_metrics_name_the_adapters(server):
    from prometheus_client.parser import text_string_to_metric_families

    complete(server, "sql")
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (info,) = families["llmserve:lora_requests_info"].samples
    assert info.labels["max_lora"] == "4" and info.labels["model_name"] == MODEL_NAME
    assert info.labels["running_lora_adapters"] == info.labels["waiting_lora_adapters"] == ""  # idle now
    counts = {
        (s.labels["lora_name"], s.labels["finished_reason"]): s.value
        for s in families["llmserve:lora_requests"].samples
        if s.name.endswith("_total")
    }
    assert counts[("sql", "length")] >= 1
