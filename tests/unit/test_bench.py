"""`llmserve.bench` without a server: datasets (exact token lengths, salts, ShareGPT filters),
statistics against numpy, the arrival schedule, SSE parsing against a local aiohttp server, and plots."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import socket
import sys
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from llmserve.bench import datasets, stats
from llmserve.bench.arrival import interarrival_times, send_times
from llmserve.bench.client import POST_ATTEMPTS, RequestRecord, build_body, send_request
from llmserve.bench.datasets import BenchRequest
from llmserve.bench.offline import LatencyTest, latency_tests
from llmserve.bench.serve import benchmark_serving
from llmserve.tokenizer import Tokenizer
from llmserve.tokenizer.hf_folder import load_hf_tokenizer
from tests.models.tiny import save_tiny_tokenizer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(folder)
    return load_hf_tokenizer(folder, "tiny")


@pytest.fixture(scope="module")
def tiny_tok_bos(tiny_tok: Tokenizer) -> Tokenizer:
    """The same vocabulary with a BOS token that encode() prepends (as Llama 3's does)."""
    return Tokenizer(
        tiny_tok.backend, name="tiny-bos", bos_token_id=0, eos_token_id=0, pad_token_id=None,
        add_bos_token=True, chat_template=None,
    )  # fmt: skip


@pytest.fixture(scope="module")
def smollm2_tok() -> Tokenizer:
    return datasets.load_bench_tokenizer(None)


@pytest.fixture(params=["tiny", "tiny_bos", "smollm2"])
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(
        {"tiny": "tiny_tok", "tiny_bos": "tiny_tok_bos", "smollm2": "smollm2_tok"}[request.param]
    )


# -- datasets ----------------------------------------------------------------------------------


@pytest.mark.parametrize("input_len", [1, 5, 16, 100])
def test_random_prompts_have_exact_token_lengths(tok: Tokenizer, input_len: int):
    if tok.add_bos_token and input_len == 1:
        input_len = 2  # BOS + one token: a prompt of length 1 would be BOS alone
    reqs = datasets.random_requests(tok, 20, input_len, 7, seed=3)
    assert len(reqs) == 20
    for r in reqs:
        ids = tok.encode(r.prompt)
        assert len(ids) == r.prompt_len == input_len
        assert r.output_len == 7
        assert (ids[0] == tok.bos_token_id) == tok.add_bos_token
    if input_len >= 5:  # single tokens of a 512-token vocabulary may repeat
        assert len({r.prompt for r in reqs}) == 20


def test_random_prompts_with_salt_keep_exact_lengths(tok: Tokenizer):
    salt = datasets.make_salt()
    reqs = datasets.random_requests(tok, 10, 32, 4, seed=1, salt=salt)
    for r in reqs:
        assert r.prompt.startswith(salt)
        assert len(tok.encode(r.prompt)) == r.prompt_len == 32


def test_random_range_ratio_bounds(tiny_tok: Tokenizer):
    reqs = datasets.random_requests(tiny_tok, 200, 40, 20, range_ratio=0.5, seed=0)
    ins = [r.prompt_len for r in reqs]
    outs = [r.output_len for r in reqs]
    assert min(ins) >= 20 and max(ins) <= 60
    assert min(outs) >= 10 and max(outs) <= 30
    assert len(set(ins)) > 10 and len(set(outs)) > 5  # spread, not a constant
    assert all(len(tiny_tok.encode(r.prompt)) == r.prompt_len for r in reqs)
    with pytest.raises(ValueError, match="range_ratio"):
        datasets.random_requests(tiny_tok, 1, 10, 10, range_ratio=1.0)
    with pytest.raises(ValueError, match="input_len"):
        datasets.random_requests(tiny_tok, 1, 0, 10)


def test_random_is_reproducible_by_seed(tiny_tok: Tokenizer):
    a = datasets.random_requests(tiny_tok, 8, 24, 8, range_ratio=0.3, seed=5)
    b = datasets.random_requests(tiny_tok, 8, 24, 8, range_ratio=0.3, seed=5)
    c = datasets.random_requests(tiny_tok, 8, 24, 8, range_ratio=0.3, seed=6)
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in c]


def test_cold_salts_differ_between_runs_warm_prompts_identical(tiny_tok: Tokenizer):
    salts = {datasets.make_salt() for _ in range(20)}
    assert len(salts) == 20
    cold1 = datasets.random_requests(tiny_tok, 5, 24, 8, seed=0, salt=datasets.make_salt())
    cold2 = datasets.random_requests(tiny_tok, 5, 24, 8, seed=0, salt=datasets.make_salt())
    warm1 = datasets.random_requests(tiny_tok, 5, 24, 8, seed=0, salt=None)
    warm2 = datasets.random_requests(tiny_tok, 5, 24, 8, seed=0, salt=None)
    assert warm1 == warm2
    # every cold prompt differs from its counterpart of the other run, from the first tokens on
    for a, b in zip(cold1, cold2, strict=True):
        assert tiny_tok.encode(a.prompt)[:2] != tiny_tok.encode(b.prompt)[:2]


@pytest.mark.parametrize("salt", [None, "c0ffee42"])
def test_prefix_prompts_share_the_exact_prefix(tok: Tokenizer, salt: str | None):
    reqs = datasets.prefix_requests(tok, 6, prefix_len=40, input_len=12, output_len=4, seed=2, salt=salt)
    prefix = os.path.commonprefix([r.prompt for r in reqs])  # noqa: RUF071 - strings, on purpose
    token_lists = [tok.encode(r.prompt) for r in reqs]
    for r, ids in zip(reqs, token_lists, strict=True):
        assert len(ids) == r.prompt_len == 52
        if salt:
            assert r.prompt.startswith(salt)
    # the first prefix_len - 1 tokens are identical (the last may merge with the suffix)
    assert all(ids[:39] == token_lists[0][:39] for ids in token_lists)
    assert len(tok.encode(prefix)) >= 39
    assert len({ids[40:] for ids in map(tuple, token_lists)}) == 6  # distinct suffixes


def test_prefix_salt_goes_only_at_the_start(tiny_tok: Tokenizer):
    reqs = datasets.prefix_requests(tiny_tok, 4, 32, 8, 4, seed=0, salt="abcd1234")
    assert all(r.prompt.count("abcd1234") == 1 and r.prompt.startswith("abcd1234") for r in reqs)


def _conv(human: str | None, gpt: str | None, first: str = "human") -> dict:
    turns = []
    if human is not None:
        turns.append({"from": "human", "value": human})
    if gpt is not None:
        turns.append({"from": "gpt", "value": gpt})
    if first == "gpt":
        turns.reverse()
    return {"id": "x", "conversations": turns}


def test_sharegpt_parsing_and_filters(tmp_path: Path, tiny_tok: Tokenizer):
    long_answer = "The quick brown fox jumps over the lazy dog. " * 30
    good = [
        _conv(f"The quick brown fox number {i} jumps", "over the lazy dog again and again") for i in range(5)
    ]
    data = [
        *good,
        _conv("fox", "over the lazy dog again"),  # prompt under 4 tokens
        _conv("The quick brown fox jumps", "ok"),  # answer under 4 tokens
        _conv("The quick brown fox jumps", None),  # no answer
        _conv("The quick brown fox jumps over", long_answer),  # over max_model_len
        {"no": "conversations"},
        {"conversations": [{"from": "system", "value": "be nice"}, *good[0]["conversations"]]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = datasets.sharegpt_requests(tiny_tok, path, 100, max_model_len=128, seed=0)
    assert len(reqs) == 6  # the 5 good ones + the one with a system turn first
    assert {r.prompt for r in reqs} == {c["conversations"][0]["value"] for c in good}
    answer_len = len(tiny_tok.encode("over the lazy dog again and again", add_special_tokens=False))
    for r in reqs:
        assert r.prompt_len == len(tiny_tok.encode(r.prompt)) >= 4
        assert r.output_len == answer_len
    # --output-len overrides the answers' lengths: the short and the long answer pass now
    fixed = datasets.sharegpt_requests(tiny_tok, path, 100, output_len=16, max_model_len=128, seed=0)
    assert len(fixed) == 8 and all(r.output_len == 16 for r in fixed)
    # ... up to max_model_len exactly: the good prompts are 14 tokens, 14 + 16 = 30
    assert {r.prompt_len for r in reqs} == {14}
    assert len(datasets.sharegpt_requests(tiny_tok, path, 100, output_len=16, max_model_len=30)) == 8
    short = datasets.sharegpt_requests(tiny_tok, path, 100, output_len=16, max_model_len=29)
    assert sorted(r.prompt_len for r in short) == [5, 6]
    # sampling: num_prompts of them, the same ones for the same seed
    a = datasets.sharegpt_requests(tiny_tok, path, 3, max_model_len=128, seed=1)
    assert len(a) == 3 and a == datasets.sharegpt_requests(tiny_tok, path, 3, max_model_len=128, seed=1)
    salted = datasets.sharegpt_requests(tiny_tok, path, 2, max_model_len=128, seed=1, salt="5a17")
    assert all(r.prompt.startswith("5a17 ") for r in salted)


def test_sharegpt_bad_files(tmp_path: Path, tiny_tok: Tokenizer):
    with pytest.raises(ValueError, match="cannot read"):
        datasets.sharegpt_requests(tiny_tok, tmp_path / "missing.json", 1)
    (tmp_path / "obj.json").write_text('{"conversations": []}')
    with pytest.raises(ValueError, match="JSON list"):
        datasets.sharegpt_requests(tiny_tok, tmp_path / "obj.json", 1)
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(ValueError, match="no conversation"):
        datasets.sharegpt_requests(tiny_tok, tmp_path / "empty.json", 1)


def test_load_bench_tokenizer_reads_no_weights(monkeypatch: pytest.MonkeyPatch):
    import llmserve.model_executor.model_loader as loader

    def no_weights(*args, **kwargs):
        raise AssertionError("load_model called")

    monkeypatch.setattr(loader, "load_model", no_weights)
    tok = datasets.load_bench_tokenizer(None)
    assert tok.name == "smollm2-135m-instruct" and tok.vocab_size == 49152


# -- statistics --------------------------------------------------------------------------------


def _record(
    ttft: float, latency: float, n_out: int, itl: list[float], ok: bool = True, n_in: int = 10
) -> RequestRecord:
    return RequestRecord(
        prompt_len=n_in, expected_output_len=n_out, success=ok, output_tokens=n_out if ok else 0,
        ttft=ttft, itl=itl, latency=latency, error="" if ok else "HTTP 500: boom",
    )  # fmt: skip


def test_distribution_matches_numpy():
    rng = np.random.default_rng(0)
    data = rng.exponential(50.0, size=1001).tolist()
    d = stats.distribution(data, "ttft")
    assert d["mean_ttft_ms"] == pytest.approx(np.mean(data))
    assert d["median_ttft_ms"] == pytest.approx(np.median(data))
    assert d["std_ttft_ms"] == pytest.approx(np.std(data))
    assert d["p90_ttft_ms"] == pytest.approx(np.percentile(data, 90))
    assert d["p99_ttft_ms"] == pytest.approx(np.percentile(data, 99))
    known = stats.distribution([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], "x")
    assert known["median_x_ms"] == 5.5 and known["p90_x_ms"] == pytest.approx(9.1)
    assert stats.distribution([], "x") == {k: 0.0 for k in known}


def test_summarize_counts_and_latencies():
    records = [
        _record(0.1, 1.0, 10, [0.1] * 9),
        _record(0.2, 2.0, 10, [0.2] * 9),
        _record(0.3, 0.3, 1, []),  # one token: no TPOT
        _record(0.0, 0.0, 10, [], ok=False),
    ]
    s = stats.summarize(records, duration_s=4.0)
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 21
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["output_throughput"] == pytest.approx(21 / 4)
    assert s["total_token_throughput"] == pytest.approx(51 / 4)
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["mean_tpot_ms"] == pytest.approx(np.mean([0.9 / 9, 1.8 / 9]) * 1e3)
    assert s["mean_itl_ms"] == pytest.approx(150.0)
    assert s["median_e2el_ms"] == pytest.approx(1000.0)
    assert s["request_goodput"] is None


def test_goodput_counts_requests_meeting_every_slo():
    records = [
        _record(0.1, 1.0, 11, []),  # ttft 100, tpot 90, e2el 1000
        _record(0.4, 1.4, 11, []),  # ttft 400, tpot 100
        _record(0.6, 1.0, 11, []),  # ttft 600, tpot 40
        _record(0.05, 0.05, 1, []),  # single token: tpot not applicable
        _record(0.0, 0.0, 11, [], ok=False),
    ]
    count = lambda slos: sum(stats.meets_slos(r, slos) for r in records)  # noqa: E731
    assert count({"ttft": 500}) == 3
    assert count({"ttft": 500, "tpot": 95}) == 2
    assert count({"tpot": 50}) == 2
    assert count({"e2el": 1000}) == 3
    s = stats.summarize(records, 2.0, {"ttft": 500, "tpot": 95})
    assert s["request_goodput"] == pytest.approx(1.0)


def test_parse_goodput():
    assert stats.parse_goodput(["ttft:500", "tpot:50.5", "e2el:2000"]) == {
        "ttft": 500.0,
        "tpot": 50.5,
        "e2el": 2000.0,
    }
    for bad in ["ttft", "itl:5", "ttft:abc", "tpot:-1"]:
        with pytest.raises(ValueError, match="goodput"):
            stats.parse_goodput([bad])


# -- arrival schedule --------------------------------------------------------------------------


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gamma_interarrival_mean_is_one_over_rate(burstiness: float):
    gaps = np.array(interarrival_times(20000, 8.0, burstiness, seed=1))
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    # Gamma(shape B): coefficient of variation 1/sqrt(B); B = 1 is Poisson (exponential gaps)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    assert interarrival_times(50, 8.0, burstiness, seed=1) == interarrival_times(50, 8.0, burstiness, seed=1)


def test_infinite_rate_sends_everything_at_once():
    assert interarrival_times(5, math.inf) == [0.0] * 5
    assert send_times(5, math.inf) == [0.0] * 5
    times = send_times(100, 10.0, seed=0)
    assert times[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(times))
    assert send_times(0, 1.0) == []
    for rate, b in [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, math.inf)]:
        with pytest.raises(ValueError):
            interarrival_times(3, rate, b)


# -- the client on a mock server -------------------------------------------------------------


def _sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _text_chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}], "usage": None}


@contextlib.asynccontextmanager
async def _server(handler):
    """An aiohttp server on a free local port answering every path with `handler`."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def _reply(body: bytes, status: int = 200):
    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=status, body=body, content_type="text/event-stream")

    return handler


async def _send_to(url: str, endpoint: str, tokenizer, prompt: str) -> RequestRecord:
    req = BenchRequest(prompt, 3, 4)
    async with aiohttp.ClientSession() as client:
        body = build_body(endpoint, "m", req)  # type: ignore[arg-type]
        return await send_request(client, f"{url}/v1/completions", body, req, endpoint, tokenizer)  # type: ignore[arg-type]


def _send(handler, endpoint: str = "completions", tokenizer=None, prompt: str = "hi") -> RequestRecord:
    async def go() -> RequestRecord:
        async with _server(handler) as url:
            return await _send_to(url, endpoint, tokenizer, prompt)

    return asyncio.run(go())


def test_client_reads_text_chunks_and_usage():
    usage = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    body = _sse(_text_chunk("a"), _text_chunk(""), _text_chunk("b"), _text_chunk("cd"),
                {"choices": [], "usage": usage}, "[DONE]")  # fmt: skip
    rec = _send(_reply(body))
    assert rec.success and rec.error == ""
    assert rec.generated_text == "abcd"
    assert rec.output_tokens == 4 and rec.prompt_len == 5  # the server's usage wins
    assert len(rec.itl) == 2  # 3 chunks with text; the empty one is not a token
    assert 0 < rec.ttft <= rec.latency


def test_client_chat_without_usage_counts_tokens_with_the_tokenizer(tiny_tok: Tokenizer):
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    parts = [{"choices": [{"index": 0, "delta": {"content": t}}]} for t in ("The quick", " brown fox")]
    body = _sse(role, *parts, "[DONE]")
    seen = {}

    async def handler(request: web.Request) -> web.Response:
        seen.update(await request.json())
        return web.Response(body=body, content_type="text/event-stream")

    rec = _send(handler, "chat", tiny_tok)
    assert seen["messages"] == [{"role": "user", "content": "hi"}]
    assert seen["stream"] and seen["stream_options"] == {"include_usage": True} and seen["ignore_eos"]
    assert seen["max_tokens"] == 4 and seen["temperature"] == 0.0
    assert rec.success and rec.generated_text == "The quick brown fox"
    assert rec.output_tokens == len(tiny_tok.encode("The quick brown fox", add_special_tokens=False))
    assert rec.prompt_len == 3 and len(rec.itl) == 1


def test_client_records_failures():
    rec = _send(_reply(json.dumps({"error": {"message": "no such model"}}).encode(), status=404))
    assert not rec.success and rec.error == "HTTP 404: no such model"
    rec = _send(_reply(_sse(_text_chunk("a"), {"error": {"message": "engine died"}})))
    assert not rec.success and rec.error == "stream error: engine died"

    with socket.socket() as s:  # a port nothing listens on: the connection is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rec = asyncio.run(_send_to(f"http://127.0.0.1:{port}", "completions", None, "hi"))
    assert not rec.success and "ClientConnectorError" in rec.error


def test_client_retries_a_closed_keepalive_connection():
    """A pooled connection the server closed fails before the request is written (aiohttp's
    ClientOSError): the request goes again; the same failure POST_ATTEMPTS times is its error."""
    usage = {"prompt_tokens": 3, "completion_tokens": 1}
    body = _sse(_text_chunk("a"), {"choices": [], "usage": usage}, "[DONE]")

    class StaleFirst:
        def __init__(self, session: aiohttp.ClientSession, failures: int) -> None:
            self.session, self.failures, self.calls = session, failures, 0

        async def post(self, url, **kw):
            self.calls += 1
            if self.calls <= self.failures:
                raise aiohttp.ClientOSError(None, "Can not write request body")
            return await self.session.post(url, **kw)

    async def go(failures: int) -> tuple[RequestRecord, int]:
        async with _server(_reply(body)) as url, aiohttp.ClientSession() as session:
            client, req = StaleFirst(session, failures), BenchRequest("hi", 3, 1)
            rec = await send_request(
                client, f"{url}/v1/completions", build_body("completions", "m", req), req, "completions"
            )  # type: ignore[arg-type]
            return rec, client.calls

    rec, calls = asyncio.run(go(POST_ATTEMPTS - 1))
    assert rec.success and rec.generated_text == "a" and calls == POST_ATTEMPTS
    rec, calls = asyncio.run(go(POST_ATTEMPTS))
    assert not rec.success and "Can not write request body" in rec.error and calls == POST_ATTEMPTS


def test_benchmark_serving_caps_concurrency_and_excludes_warmups():
    in_flight, peak, prompts = 0, 0, []

    async def handler(request: web.Request) -> web.Response:
        nonlocal in_flight, peak
        prompts.append((await request.json())["prompt"])
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        usage = {"prompt_tokens": 3, "completion_tokens": 2}
        body = _sse(_text_chunk("x"), _text_chunk("y"), {"choices": [], "usage": usage}, "[DONE]")
        return web.Response(body=body, content_type="text/event-stream")

    async def go():
        async with _server(handler) as url:
            return await benchmark_serving(f"{url}/v1", "m", reqs, max_concurrency=3, num_warmups=2,
                                           progress=False, goodput={"ttft": 60_000})  # fmt: skip

    reqs = [BenchRequest(f"prompt {i}", 3, 2) for i in range(10)]
    result = asyncio.run(go())
    assert peak == 3
    assert len(prompts) == 12 and prompts[:2] == ["warmup 0 prompt 0", "warmup 1 prompt 1"]
    d = result.to_dict()
    assert d["completed"] == 10 and d["failed"] == 0 and d["num_warmups"] == 2
    assert d["total_output_tokens"] == 20 and d["total_input_tokens"] == 30
    assert d["request_rate"] == "inf" and d["max_concurrency"] == 3 and len(d["requests"]) == 10
    assert d["request_goodput"] == pytest.approx(d["request_throughput"])
    json.dumps(d, allow_nan=False)  # plain JSON


def test_benchmark_serving_rejects_bad_arguments():
    reqs = [BenchRequest([1, 2, 3], 3, 2)]
    for kwargs, match in [
        ({"endpoint": "embeddings"}, "endpoint"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"endpoint": "chat"}, "text prompts"),
        ({"request_rate": 0.0}, "request_rate"),
    ]:
        with pytest.raises(ValueError, match=match):
            asyncio.run(benchmark_serving("http://x", "m", reqs, progress=False, **kwargs))


# -- plots and latency tests -------------------------------------------------------------------


def _result_dict(concurrency: int, ttft_ms: float, tput: float) -> dict:
    records = [_record(ttft_ms / 1e3 * (1 + i / 10), 1.0, 8, [0.05] * 7) for i in range(10)]
    s = stats.summarize(records, 2.0)
    s["output_throughput"] = tput
    return {"model": "m", "base_url": "u", "max_concurrency": concurrency, **s,
            "requests": [r.to_dict() for r in records]}  # fmt: skip


def test_plots_write_pngs(tmp_path: Path):
    from llmserve.bench import plots

    results = [_result_dict(c, 10.0 * c, 100.0 * c) for c in (1, 4)]
    for path in [
        plots.plot_latencies(results[0], tmp_path / "lat.png"),
        plots.plot_sweep(results, tmp_path / "sweep.png"),
        plots.plot_sweep(
            None, tmp_path / "two.png", series={"llmserve": results, "llama-server": results[:1]}
        ),
        plots.plot_sweep_series({"a": results}, tmp_path / "series.png", labels={"a": ["one", "four"]}),
    ]:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
    with pytest.raises(ValueError, match="labels"):
        plots.plot_sweep(results, tmp_path / "bad.png", labels=["only one"])


def test_plots_without_matplotlib_say_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    from llmserve.bench import plots

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` fail
    with pytest.raises(plots.MissingPlotDependency, match=r"pip install llmserve\[bench\]"):
        plots.plot_latencies(_result_dict(1, 10.0, 100.0), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_latency_tests_names_and_validation():
    tests = latency_tests([128, 512], [64], batch_size=4)
    assert [t.name for t in tests] == ["pp128", "pp512", "tg64 @ b4"]
    assert tests[0] == LatencyTest("pp", 128, 1)
    assert latency_tests([], [32], 1)[0].name == "tg32"
    for args in [([0], [], 1), ([], [1], 1), ([8], [8], 0)]:
        with pytest.raises(ValueError):
            latency_tests(*args)
