"""Several models behind one server (issue 13): routing by `model` with interleaved concurrent
requests, names with tags and aliases, loading on demand (requests wait for a load; a bounded wait
answers 503), LRU eviction under --max-loaded-models and --models-memory, a broken model beside
good ones, the admin routes and Ollama's keep_alive, and the `openai` engine proxying a second
llmserve process (streaming, errors passed through, a disconnect aborting the upstream request)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import ollama
import pytest
from openai.types import Model
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import CHAT_TEMPLATE, MODEL_NAME, ServerProcess, free_port
from tests.models.tiny import make_tiny_model

pytestmark = pytest.mark.e2e

PROMPTS = ["The quick brown fox", "0123456789", "naïve café over the"]
CARD_EXTRAS = (
    "max_model_len", "state", "engine", "aliases", "size", "memory_bytes", "digest", "error", "expires_at",
)  # fmt: skip


@pytest.fixture(scope="module")
def second_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another tiny model (Qwen2, other weights): the same prompt gives another continuation."""
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    make_tiny_model("qwen2", folder, seed=1)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def broken_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny model's config and tokenizer with a weights file that is not safetensors."""
    folder = tmp_path_factory.mktemp("broken")
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a safetensors file")
    return folder


def complete(server: ServerProcess, model: str, prompt: str, max_tokens: int = 12) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def states(server: ServerProcess) -> dict[str, str]:
    r = httpx.get(f"{server.url}/v1/models", timeout=10)
    assert r.status_code == 200, r.text
    return {m["id"]: m["state"] for m in r.json()["data"]}


def samples(server: ServerProcess, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of the metric `name`, keyed by its labels."""
    r = httpx.get(f"{server.url}/metrics", timeout=10)
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    return sum(v for k, v in samples(server, name).items() if labels.items() <= dict(k).items())


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


# -- two models at once ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path, second_model_dir: Path, tmp_path_factory) -> ServerProcess:
    proc = ServerProcess(
        [f"a={tiny_model_dir}", f"b:v1={second_model_dir}"], "--preload", "all",
        served_name=None, log_dir=tmp_path_factory.mktemp("pair"),
    ).start()  # fmt: skip
    yield proc
    proc.stop()


def test_two_models_interleaved(pair: ServerProcess) -> None:
    """Interleaved concurrent requests to both models give each model's own greedy text (what
    the same request gives alone); the two models differ; each model's requests are counted
    under its own name and engine."""
    assert states(pair) == {"a": "loaded", "b:v1": "loaded"}
    alone = {(m, p): text_of(complete(pair, m, p)) for m in ("a", "b:v1") for p in PROMPTS}
    assert any(alone["a", p] != alone["b:v1", p] for p in PROMPTS)
    jobs = [(m, p) for p in PROMPTS for m in ("a", "b:v1")] * 3
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda job: text_of(complete(pair, *job)), jobs))
    assert got == [alone[job] for job in jobs]
    for model in ("a", "b:v1"):
        n = metric(pair, "llmserve:request_success_total", model_name=model, engine="native")
        assert n == len(PROMPTS) + 3 * len(PROMPTS)


def test_names_tags_and_unknown_models(pair: ServerProcess) -> None:
    """`b` (no tag) is b:v1, its only version; an unknown name is an OpenAI-shaped 404 naming what
    is served; the listing validates as the openai client's Model."""
    assert text_of(complete(pair, "b", PROMPTS[0])) == text_of(complete(pair, "b:v1", PROMPTS[0]))
    r = complete(pair, "b:v1", PROMPTS[0])
    assert r.json()["model"] == "b:v1"
    err = assert_error(complete(pair, "c", PROMPTS[0]), 404, "model_not_found")
    assert "'a'" in err["message"] and "'b:v1'" in err["message"]
    assert_error(complete(pair, "a:v2", PROMPTS[0]), 404, "model_not_found")
    for card in httpx.get(f"{pair.url}/v1/models").json()["data"]:
        Model.model_validate(card)
        assert set(card) - set(Model.model_fields) <= set(CARD_EXTRAS)
        assert card["engine"] == "native" and card["size"] > 0
    r = httpx.get(f"{pair.url}/v1/models/b:v1")
    assert r.status_code == 200 and r.json()["id"] == "b:v1"
    # no `model` at all: the default model (the first)
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
    default = httpx.post(f"{pair.url}/v1/completions", json=body, timeout=60)
    assert text_of(default) == text_of(complete(pair, "a", PROMPTS[0]))


def test_ollama_client_sees_every_model(pair: ServerProcess) -> None:
    client = ollama.Client(host=pair.url)
    assert sorted(m.model for m in client.list().models) == ["a", "b:v1"]
    assert sorted(m.model for m in client.ps().models) == ["a", "b:v1"]
    options = {"temperature": 0, "num_predict": 12, "repeat_penalty": 1.0, "top_k": 0, "top_p": 1.0}
    r = client.generate(model="b:v1", prompt=PROMPTS[1], raw=True, options=options)
    assert r.response == text_of(complete(pair, "b:v1", PROMPTS[1]))


# -- loading on demand and eviction ------------------------------------------------------------------


@pytest.fixture(scope="module")
def lru(tiny_model_dir: Path, tmp_path_factory) -> ServerProcess:
    proc = ServerProcess(
        [f"x={tiny_model_dir}", f"y={tiny_model_dir}", f"z={tiny_model_dir}"],
        "--preload", "none", "--max-loaded-models", "2",
        served_name=None, log_dir=tmp_path_factory.mktemp("lru"),
    ).start()  # fmt: skip
    yield proc
    proc.stop()


def test_requests_wait_for_a_loading_model(lru: ServerProcess) -> None:
    """Nothing preloaded: the server is healthy at once; four concurrent requests for an unloaded
    model all wait for its one load and succeed."""
    assert states(lru) == {"x": "unloaded", "y": "unloaded", "z": "unloaded"}
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda p: text_of(complete(lru, "x", p)), [PROMPTS[0]] * 4))
    assert len(set(texts)) == 1
    assert metric(lru, "llmserve:model_loads_total", model_name="x", outcome="loaded") == 1
    assert states(lru)["x"] == "loaded"


def test_least_recently_used_model_is_evicted(lru: ServerProcess) -> None:
    """--max-loaded-models 2: loading a third model unloads the least recently used one."""
    expected = text_of(complete(lru, "x", PROMPTS[0]))
    text_of(complete(lru, "y", PROMPTS[0]))
    assert states(lru) == {"x": "loaded", "y": "loaded", "z": "unloaded"}
    assert text_of(complete(lru, "z", PROMPTS[0])) == expected  # x was used before y: x goes
    assert states(lru) == {"x": "unloaded", "y": "loaded", "z": "loaded"}
    text_of(complete(lru, "y", PROMPTS[1]))  # now z is the least recently used
    assert text_of(complete(lru, "x", PROMPTS[0])) == expected  # loaded again, same weights
    assert states(lru) == {"x": "loaded", "y": "loaded", "z": "unloaded"}
    assert metric(lru, "llmserve:model_loaded", model_name="z") == 0
    assert metric(lru, "llmserve:model_loaded", model_name="x") == 1
    assert "evicted (least recently used) to load 'z'" in lru.log()


def test_admin_load_unload_and_ollama_keep_alive(lru: ServerProcess) -> None:
    """The admin routes load and unload; Ollama's keep_alive 0 unloads, a keep_alive of a second
    unloads the model once it has been idle that long, and /api/ps shows the expiry."""
    r = httpx.post(f"{lru.url}/admin/models/unload", json={"model": "x"}, timeout=60)
    assert r.status_code == 200 and r.json()["state"] == "unloaded"
    r = httpx.post(f"{lru.url}/admin/models/load", json={"model": "z"}, timeout=60)
    assert r.status_code == 200 and r.json()["state"] == "loaded", r.text
    assert_error(httpx.post(f"{lru.url}/admin/models/load", json={"model": "nope"}), 404)
    assert_error(httpx.post(f"{lru.url}/admin/models/load", json={"modle": "x"}), 400)
    client = ollama.Client(host=lru.url)
    assert client.generate(model="z", keep_alive=0).done_reason == "unload"
    assert states(lru)["z"] == "unloaded"
    client.generate(model="z", keep_alive="1s")  # an empty prompt loads the model
    (entry,) = [m for m in client.ps().models if m.model == "z"]
    assert entry.expires_at is not None and entry.expires_at.year < 9999
    deadline = time.monotonic() + 10
    while states(lru)["z"] != "unloaded":
        assert time.monotonic() < deadline, "keep_alive 1s never unloaded z"
        time.sleep(0.2)
    r = httpx.post(f"{lru.url}/api/generate", json={"model": "z", "keep_alive": "soon"})
    assert r.status_code == 400 and r.json()["error"].startswith("keep_alive: cannot read 'soon'"), r.text


# -- a memory budget, a models file, aliases and default versions ----------------------------------


@pytest.fixture(scope="module")
def budget(tiny_model_dir: Path, tmp_path_factory) -> tuple[ServerProcess, int]:
    from llmserve.config.engine_args import EngineArgs
    from llmserve.server.model_files import estimate_size

    size = estimate_size(
        str(tiny_model_dir), sum(p.stat().st_size for p in tiny_model_dir.glob("*.safetensors")),
        EngineArgs(num_kv_blocks=256, block_size=16),
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("budget")
    (folder / "models.yaml").write_text(
        f"""
models:
  - name: tiny:a
    source: {tiny_model_dir}
    aliases: [first]
    preload: true
  - name: tiny:b
    source: {tiny_model_dir}
    default: true
  - name: huge
    source: {tiny_model_dir}
    options: {{num_kv_blocks: 400000}}
"""
    )
    proc = ServerProcess(
        [], "--config", str(folder / "models.yaml"), "--models-memory", str(int(1.5 * size)),
        served_name=None, log_dir=folder,
    ).start()  # fmt: skip
    yield proc, size
    proc.stop()


def test_memory_budget_evicts_and_refuses(budget: tuple[ServerProcess, int]) -> None:
    """Room for one tiny model: the second evicts the first; a model larger than the whole budget
    is refused with a 503 that says so, and the loaded one keeps serving. The estimate a load is
    admitted on is the size measured after it."""
    server, size = budget
    (a,) = [m for m in httpx.get(f"{server.url}/v1/models").json()["data"] if m["id"] == "tiny:a"]
    assert a["state"] == "loaded" and a["aliases"] == ["first"]
    assert abs(a["memory_bytes"] - size) / size < 0.1, (a["memory_bytes"], size)
    (huge,) = [m for m in httpx.get(f"{server.url}/v1/models").json()["data"] if m["id"] == "huge"]
    assert huge["memory_bytes"] > 100 * size and huge["size"] == a["size"]  # estimated; the same files
    expected = text_of(complete(server, "first", PROMPTS[0]))  # the alias
    assert text_of(complete(server, "tiny", PROMPTS[0])) == expected  # no tag: the default, tiny:b
    assert states(server) == {"tiny:a": "unloaded", "tiny:b": "loaded", "huge": "unloaded"}
    err = assert_error(complete(server, "huge", PROMPTS[0]), 503, "model_too_large")
    assert "--models-memory" in err["message"]
    assert states(server)["tiny:b"] == "loaded"
    assert text_of(complete(server, "tiny:b", PROMPTS[0])) == expected


# -- a broken model beside good ones; a bounded wait -------------------------------------------------


@pytest.fixture(scope="module")
def with_broken(tiny_model_dir: Path, broken_model_dir: Path, tmp_path_factory) -> ServerProcess:
    proc = ServerProcess(
        # lazy: the embedded model, whose load (a second or so) outlasts the 0.01 s wait; the
        # tiny one loads in a few ms, too fast to be caught loading
        [f"good={tiny_model_dir}", f"broken={broken_model_dir}", "lazy=smollm2-135m-instruct"],
        "--preload", "first", "--model-load-timeout", "0.01",
        served_name=None, log_dir=tmp_path_factory.mktemp("broken-server"),
    ).start()  # fmt: skip
    yield proc
    proc.stop()


def poll(server: ServerProcess, model: str, until_code_is_not: str, timeout: float = 60) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        r = complete(server, model, PROMPTS[0])
        if r.status_code != 503 or r.json()["error"]["code"] != until_code_is_not:
            return r
        assert r.headers.get("retry-after") == "5"
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_broken_model_beside_good_ones(with_broken: ServerProcess) -> None:
    """A model whose weights cannot load answers 503 with the reason, shows `failed` with the
    error in /v1/models, and leaves the server healthy and the other models serving."""
    good = text_of(complete(with_broken, "good", PROMPTS[0]))
    err = assert_error(poll(with_broken, "broken", "model_loading"), 503, "model_load_failed")
    assert "loading the model 'broken' failed" in err["message"]
    (card,) = [m for m in httpx.get(f"{with_broken.url}/v1/models").json()["data"] if m["id"] == "broken"]
    assert card["state"] == "failed" and card["error"]
    assert httpx.get(f"{with_broken.url}/health").status_code == 200
    assert text_of(complete(with_broken, "good", PROMPTS[0])) == good
    assert metric(with_broken, "llmserve:model_loads_total", model_name="broken", outcome="failed") == 1


def test_a_bounded_wait_answers_503_then_the_load_completes(with_broken: ServerProcess) -> None:
    """--model-load-timeout 0.01: the first request for an unloaded model gets 503 (model_loading,
    Retry-After) while the load goes on; a retry is served."""
    first = complete(with_broken, "lazy", "The capital of France is")
    assert_error(first, 503, "model_loading")
    assert first.headers["retry-after"] == "5"
    deadline = time.monotonic() + 120
    while (r := complete(with_broken, "lazy", "The capital of France is")).status_code == 503:
        assert r.json()["error"]["code"] == "model_loading" and time.monotonic() < deadline, r.text
        time.sleep(0.2)
    assert "Paris" in text_of(r)


# -- the openai engine: another llmserve as the upstream ---------------------------------------------


@pytest.fixture(scope="module")
def upstream(tiny_model_dir: Path) -> ServerProcess:
    """The tiny model behind a slow engine (each step sleeps 20 ms), so a stream outlives a
    client that leaves early."""
    proc = ServerProcess(
        tiny_model_dir, module="tests.e2e.slow_server", env={"LLMSERVE_TEST_STEP_DELAY": "0.02"}
    ).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def neox_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-NeoX: an architecture with no native implementation."""
    folder = tmp_path_factory.mktemp("tiny-neox")
    make_tiny_model("gpt_neox", folder)
    return folder


@pytest.fixture(scope="module")
def proxy(
    upstream: ServerProcess, tiny_model_dir: Path, neox_model_dir: Path, tmp_path_factory
) -> ServerProcess:
    """A server of four engines: native, transformers (asked for, and as the fallback for an
    architecture without a native implementation) and openai (one upstream that answers, one
    that nobody listens on)."""
    folder = tmp_path_factory.mktemp("proxy")
    (folder / "models.yaml").write_text(
        f"""
models:
  - name: local
    source: {tiny_model_dir}
    preload: true
  - name: up
    engine: openai
    source: {upstream.url}/v1
    options: {{model: {MODEL_NAME}}}
  - name: down
    engine: openai
    source: http://127.0.0.1:{free_port()}/v1
  - name: hf
    engine: transformers
    source: {tiny_model_dir}
  - name: neox
    source: {neox_model_dir}
"""
    )
    proc = ServerProcess(
        [], "--config", str(folder / "models.yaml"), served_name=None, log_dir=folder
    ).start()
    yield proc
    proc.stop()


def test_remote_engine_relays_answers_and_streams(proxy: ServerProcess, upstream: ServerProcess) -> None:
    direct = complete(upstream, MODEL_NAME, PROMPTS[0])
    relayed = complete(proxy, "up", PROMPTS[0])
    assert text_of(relayed) == text_of(direct) and relayed.json()["model"] == "up"
    messages = [{"role": "user", "content": "The quick brown fox"}]
    whole = proxy.client().chat.completions.create(
        model="up", messages=messages, max_tokens=10, temperature=0
    )
    chunks = list(proxy.client().chat.completions.create(
        model="up", messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )
    assert {c.model for c in chunks} == {"up"} and chunks[-1].usage.completion_tokens == 10
    before = metric(proxy, "llmserve:generation_tokens_total", model_name="up", engine="openai")
    plain = list(proxy.client().chat.completions.create(
        model="up", messages=messages, max_tokens=10, temperature=0, stream=True
    ))  # fmt: skip
    assert all(c.usage is None and c.choices for c in plain)  # the usage the proxy asked for is not shown
    after = metric(proxy, "llmserve:generation_tokens_total", model_name="up", engine="openai")
    assert after - before == 10  # but counted
    states_now = {
        m["id"]: (m["state"], m["engine"]) for m in httpx.get(f"{proxy.url}/v1/models").json()["data"]
    }
    assert states_now["up"] == ("loaded", "openai")
    assert metric(proxy, "llmserve:request_success_total", model_name="up", engine="openai") >= 3
    assert metric(proxy, "llmserve:generation_tokens_total", model_name="up", engine="openai") >= 10
    assert metric(proxy, "llmserve:time_to_first_token_seconds_count", model_name="up", engine="openai") >= 1


def test_remote_engine_errors(proxy: ServerProcess) -> None:
    """The upstream's own 4xx comes back as it was; an upstream nobody listens on is a 502 (on
    Ollama's API too, in its shape); the server keeps serving; the tokenizer routes say the remote
    model is not theirs."""
    err = assert_error(complete(proxy, "up", "fox " * 400), 400)
    assert "256" in err["message"]  # the upstream's context check, not ours
    err = assert_error(complete(proxy, "down", PROMPTS[0]), 502)
    assert "cannot reach the upstream" in err["message"]
    assert_error(httpx.post(f"{proxy.url}/tokenize", json={"model": "up", "prompt": "x"}), 400)
    r = httpx.post(f"{proxy.url}/api/generate", json={"model": "down", "prompt": "x", "stream": False})
    assert r.status_code == 502 and "cannot reach the upstream" in r.json()["error"]  # Ollama's shape
    assert text_of(complete(proxy, "local", PROMPTS[0]))


def test_ollama_api_reaches_a_remote_model(proxy: ServerProcess, upstream: ServerProcess) -> None:
    """Ollama's requests for a remote model go upstream as the OpenAI requests they mean: the
    same greedy text as the upstream's own Ollama API gives, whole and streamed, with counts."""
    options = {"temperature": 0, "num_predict": 10, "repeat_penalty": 1.0, "top_k": 0, "top_p": 1.0}
    via, direct = ollama.Client(host=proxy.url), ollama.Client(host=upstream.url)
    want = direct.generate(model=MODEL_NAME, prompt=PROMPTS[0], raw=True, options=options)
    got = via.generate(model="up", prompt=PROMPTS[0], raw=True, options=options)
    assert got.response == want.response and got.eval_count == 10 and got.done_reason == "length"
    messages = [{"role": "user", "content": "The quick brown fox"}]
    want = direct.chat(model=MODEL_NAME, messages=messages, options=options)
    parts = list(via.chat(model="up", messages=messages, options=options, stream=True))
    assert "".join(p.message.content for p in parts) == want.message.content
    assert parts[-1].done and parts[-1].prompt_eval_count == want.prompt_eval_count


def test_remote_engine_disconnect_aborts_upstream(proxy: ServerProcess, upstream: ServerProcess) -> None:
    """A client that leaves a relayed stream early closes the upstream connection, and the
    upstream aborts the request (its blocks freed, counted as an abort there)."""
    before = metric(upstream, "llmserve:request_success_total", finished_reason="abort")
    body = {"model": "up", "prompt": "The quick", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{proxy.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        got: list[str] = []
        for line in r.iter_lines():
            if line.startswith("data:"):
                got.append(line)
            if len(got) == 3:
                break
    deadline = time.monotonic() + 10
    while metric(upstream, "llmserve:request_success_total", finished_reason="abort") == before:
        assert time.monotonic() < deadline, "the upstream never aborted the request"
        time.sleep(0.1)
    stats = httpx.get(f"{upstream.url}/stats").json()
    assert stats["num_active_requests"] == 0 and stats["kv_blocks_used"] == 0


def test_transformers_engine_beside_the_native_one(proxy: ServerProcess, neox_model_dir: Path) -> None:
    """The same weights on the transformers engine give the native engine's greedy text, streamed
    through the same serving layer; an architecture with no native implementation loads on
    transformers by itself; both count under engine="transformers"."""
    messages = [{"role": "user", "content": "The quick brown fox"}]
    native = proxy.client().chat.completions.create(
        model="local", messages=messages, max_tokens=10, temperature=0
    )
    chunks = list(proxy.client().chat.completions.create(
        model="hf", messages=messages, max_tokens=10, temperature=0, stream=True
    ))  # fmt: skip
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == native.choices[0].message.content
    )
    assert text_of(complete(proxy, "neox", PROMPTS[0]))
    cards = {m["id"]: m for m in httpx.get(f"{proxy.url}/v1/models").json()["data"]}
    assert (cards["hf"]["engine"], cards["neox"]["engine"], cards["local"]["engine"]) == (
        "transformers",
        "transformers",
        "native",
    )
    for model in ("hf", "neox"):
        assert metric(proxy, "llmserve:request_success_total", model_name=model, engine="transformers") >= 1
    assert "several times slower than native" in proxy.log()
