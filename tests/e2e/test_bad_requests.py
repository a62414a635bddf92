"""Bad requests against a real server: each gets its exact 4xx status and an OpenAI-shaped error
body (`{"error": {"message", "type", "param", "code"}}`) naming the parameter at fault, and the
request after it is served normally. A bad request never produces a 5xx."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess

pytestmark = pytest.mark.e2e

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
VOCAB = 512  # the tiny model's
MAX_MODEL_LEN = 256
LONG_PROMPT = "The quick brown fox. " * 60  # about 300 tokens: more than the context alone


@dataclass(frozen=True)
class Bad:
    """One bad request and the answer it must get."""

    name: str
    body: Any  # a JSON value, or raw bytes sent as they are
    param: str | None = None
    status: int = 400
    path: str = CMPL
    method: str = "POST"


def cmpl(name: str, param: str | None, status: int = 400, **fields: Any) -> Bad:
    """A completion request that is good but for `fields`."""
    return Bad(name, {"prompt": "hello", "max_tokens": 4, **fields}, param, status)


def chat(name: str, param: str | None, status: int = 400, **fields: Any) -> Bad:
    return Bad(name, {"messages": MESSAGES, "max_tokens": 4, **fields}, param, status, path=CHAT)


CASES = [
    # -- not a request at all
    Bad("malformed-json", b'{"prompt": "hello",'),
    Bad("body-is-array", b"[]"),
    Bad("body-is-string", b'"x"'),
    Bad("body-is-number", b"3"),
    Bad("body-is-null", b"null", path=CHAT),
    Bad("missing-prompt", {"max_tokens": 4}, "prompt"),
    Bad("missing-messages", {"max_tokens": 4}, "messages", path=CHAT),
    # -- wrong types
    cmpl("prompt-number", "prompt", prompt=3),
    cmpl("prompt-bools", "prompt", prompt=[True, False]),
    cmpl("prompt-floats", "prompt", prompt=[1.5]),
    cmpl("max-tokens-string", "max_tokens", max_tokens="4"),
    cmpl("temperature-string", "temperature", temperature="hot"),
    cmpl("stream-string", "stream", stream="yes"),
    cmpl("stop-ints", "stop", stop=[1]),
    cmpl("include-usage-string", "stream_options", stream_options={"include_usage": "yes"}),
    chat("n-string", "n", n="2"),
    chat("messages-string", "messages", messages="hi"),
    # -- bad messages
    chat("unknown-role", "messages", messages=[{"role": "wizard", "content": "hi"}]),
    chat("missing-role", "messages", messages=[{"content": "hi"}]),
    chat("content-number", "messages", messages=[{"role": "user", "content": 5}]),
    chat("image-part", "messages",
         messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
    # found by the OpenAPI fuzzer: a text part without a string `text` was a 500 (AttributeError)
    chat("text-part-without-text", "messages", messages=[{"role": "user", "content": [{"type": "text"}]}]),
    chat("text-part-number", "messages", messages=[{"role": "user", "content": [{"type": "text", "text": 3}]}]),
    chat("empty-messages", "messages", messages=[]),
    chat("template-kwargs-clash", "chat_template_kwargs", chat_template_kwargs={"add_generation_prompt": False}),
    chat("continue-without-assistant", "messages", continue_final_message=True, add_generation_prompt=False),
    # -- unknown model
    cmpl("unknown-model", "model", 404, model="gpt-9"),
    chat("unknown-model-chat", "model", 404, model="gpt-9"),
    Bad("unknown-model-card", None, "model", 404, path="/v1/models/gpt-9", method="GET"),
    # -- out of range
    cmpl("temperature-high", "temperature", temperature=2.5),
    cmpl("temperature-negative", "temperature", temperature=-0.1),
    cmpl("top-p-zero", "top_p", top_p=0),
    cmpl("top-p-high", "top_p", top_p=1.5),
    cmpl("top-k-negative", "top_k", top_k=-2),
    cmpl("min-p-high", "min_p", min_p=1.5),
    cmpl("repetition-penalty-zero", "repetition_penalty", repetition_penalty=0),
    cmpl("presence-penalty-high", "presence_penalty", presence_penalty=2.5),
    cmpl("frequency-penalty-low", "frequency_penalty", frequency_penalty=-2.5),
    cmpl("n-zero", "n", n=0),
    cmpl("n-over-cap", "n", n=17),
    cmpl("logprobs-over-cap", "logprobs", logprobs=21),
    cmpl("logprobs-negative", "logprobs", logprobs=-1),
    chat("top-logprobs-over-cap", "top_logprobs", logprobs=True, top_logprobs=21),
    chat("top-logprobs-without-logprobs", "top_logprobs", top_logprobs=2),
    cmpl("max-tokens-negative", "max_tokens", max_tokens=-1),
    cmpl("max-tokens-0-without-echo", "max_tokens", max_tokens=0),
    chat("max-completion-tokens-0", "max_completion_tokens", max_completion_tokens=0),
    cmpl("min-tokens-over-max-tokens", "min_tokens", min_tokens=5),
    cmpl("min-tokens-negative", "min_tokens", min_tokens=-1),
    cmpl("seed-negative", "seed", seed=-1),
    cmpl("seed-too-large", "seed", seed=2**63),
    # -- caps
    cmpl("too-many-stop-strings", "stop", stop=[f"s{i}" for i in range(17)]),
    cmpl("stop-string-too-long", "stop", stop="x" * 257),
    cmpl("stop-string-empty", "stop", stop=[""]),
    cmpl("too-many-prompts", "prompt", prompt=["hello"] * 257),
    cmpl("empty-prompt-list", "prompt", prompt=[]),
    cmpl("empty-prompt", "prompt", prompt=""),
    # -- token ids outside the vocabulary
    cmpl("prompt-id-over-vocab", "prompt", prompt=[5, VOCAB]),
    cmpl("prompt-id-negative", "prompt", prompt=[-1]),
    cmpl("prompt-ids-list-over-vocab", "prompt", prompt=[[5, 6], [VOCAB + 10]]),
    cmpl("stop-token-id-over-vocab", "stop_token_ids", stop_token_ids=[VOCAB]),
    cmpl("stop-token-id-negative", "stop_token_ids", stop_token_ids=[-1]),
    # -- logit_bias
    cmpl("logit-bias-key-not-int", "logit_bias", logit_bias={"a": 1}),
    cmpl("logit-bias-value-string", "logit_bias", logit_bias={"5": "x"}),
    cmpl("logit-bias-value-high", "logit_bias", logit_bias={"5": 101}),
    cmpl("logit-bias-id-over-vocab", "logit_bias", logit_bias={str(VOCAB): 1}),
    cmpl("logit-bias-id-negative", "logit_bias", logit_bias={"-1": 1}),
    # -- context overflow (prompt + max_tokens > max_model_len), also when streaming
    cmpl("overflow-max-tokens", "max_tokens", max_tokens=MAX_MODEL_LEN),
    cmpl("overflow-prompt", "max_tokens", prompt=LONG_PROMPT),
    cmpl("overflow-prompt-streamed", "max_tokens", prompt=LONG_PROMPT, stream=True),
    chat("overflow-chat-streamed", "max_tokens", max_tokens=MAX_MODEL_LEN, stream=True),
    # -- unsupported fields, malformed constraints and tools
    cmpl("best-of-not-n", "best_of", best_of=2),
    cmpl("suffix", "suffix", suffix="!"),
    chat("response-format-unknown-type", "response_format", response_format={"type": "xml"}),
    chat("response-format-schema-missing", "response_format", response_format={"type": "json_schema"}),
    chat("response-format-schema-invalid", "response_format",
         response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}),
    cmpl("guided-regex-invalid", "guided_regex", guided_regex="[unclosed"),
    cmpl("guided-choice-empty", "guided_choice", guided_choice=[]),
    cmpl("structured-outputs-two-kinds", "structured_outputs", structured_outputs={"regex": "a", "choice": ["b"]}),
    chat("tools-bad-name", "tools", tools=[{"type": "function", "function": {"name": "no spaces"}}]),
    chat("tools-not-function", "tools", tools=[{"type": "code_interpreter"}]),
    chat("tool-choice-without-tools", "tool_choice", tool_choice="required"),
    chat("tool-choice-unknown-function", "tool_choice", tools=[{"type": "function", "function": {"name": "f"}}],
         tool_choice={"type": "function", "function": {"name": "g"}}),
    # -- the tokenizer routes
    Bad("detokenize-over-vocab", {"tokens": [5, VOCAB]}, "tokens", path="/detokenize"),
    Bad("detokenize-negative", {"tokens": [-1]}, "tokens", path="/detokenize"),
    Bad("tokenize-prompt-and-messages", {"prompt": "a", "messages": MESSAGES}, "prompt", path="/tokenize"),
    # -- HTTP itself
    Bad("get-completions", None, None, 405, method="GET"),
    Bad("post-models", {}, None, 405, path="/v1/models"),
    Bad("unknown-path", {}, None, 404, path="/v1/engines"),
    Bad("body-too-large", b'{"prompt": "' + b"a" * (8 * 2**20) + b'"}', None, 413),
]  # fmt: skip


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def send(http: httpx.Client, case: Bad) -> httpx.Response:
    if isinstance(case.body, bytes):
        return http.request(
            case.method, case.path, content=case.body, headers={"content-type": "application/json"}
        )
    if case.body is None:
        return http.request(case.method, case.path)
    return http.request(case.method, case.path, json=case.body)


def assert_error(r: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    """An OpenAI-shaped error: `{"error": {"message", "type", "param", "code"}}`, as plain JSON."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json", r.text  # never an SSE stream
    body = r.json()
    assert list(body) == ["error"], body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"].strip()
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] == param, error
    return error


def assert_serving(http: httpx.Client) -> None:
    r = http.post(CMPL, json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1


def test_the_table_is_wide() -> None:
    assert len(CASES) >= 30
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bad_request(http: httpx.Client, case: Bad) -> None:
    assert_error(send(http, case), case.status, case.param)
    assert_serving(http)


def test_context_overflow_names_both_numbers(http: httpx.Client) -> None:
    prompt = "The quick brown fox jumps over the lazy dog."
    num_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    max_tokens = MAX_MODEL_LEN - num_prompt + 1
    for stream in (False, True):
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": stream}
        message = assert_error(http.post(CMPL, json=body), 400, "max_tokens")["message"]
        assert str(num_prompt) in message and str(max_tokens) in message and str(MAX_MODEL_LEN) in message
    # exactly the context is fine
    r = http.post(CMPL, json={"prompt": prompt, "max_tokens": max_tokens - 1, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == MAX_MODEL_LEN


def test_unknown_fields_are_ignored(http: httpx.Client) -> None:
    r = http.post(CMPL, json={"prompt": "hello", "max_tokens": 2, "store": True, "metadata": {"a": "b"}})
    assert r.status_code == 200, r.text


def test_a_request_refused_inside_the_engine_fails_alone(http: httpx.Client) -> None:
    """Checks that only the engine thread makes (here: n seeds derived from seed 2^63 - 1) fail that
    request with an OpenAI-shaped 4xx (before or after streaming began), never the step loop."""
    body = {"prompt": "hello", "max_tokens": 2, "n": 2, "seed": 2**63 - 1}
    r = http.post(CMPL, json=body)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert_error(r, 400, "seed")
    with http.stream("POST", CMPL, json={**body, "stream": True}) as s:
        assert s.status_code in (200, 400)
        text = s.read().decode()
    if s.status_code == 200:
        events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        payloads = [json.loads(e) for e in events[:-1]]
        errors = [i for i, p in enumerate(payloads) if "error" in p]
        if errors:  # an error after streaming began: one `data: {"error": ...}` event, then [DONE]
            assert errors == [len(payloads) - 1], payloads
            error = payloads[-1]["error"]
            assert error["message"] and error["type"] == "invalid_request_error" and error["param"] == "seed"
    assert http.get("/health").status_code == 200
    assert_serving(http)
