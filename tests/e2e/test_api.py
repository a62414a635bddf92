"""The OpenAI API of a real server, driven by the `openai` client (and httpx for raw SSE).

Every response and stream chunk is also validated against the client's own pydantic types on the
raw JSON, so a missing field or a field the types do not know (other than vLLM's `stop_reason`)
fails here before it fails a user's client. Greedy requests are compared across paths (streamed vs
not, string vs token-id prompts, chat vs completions) and echoed prompt logprobs against
transformers on the same checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pydantic
import pytest
from openai.types import Completion, CompletionChoice, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_choice import Logprobs

from llmserve import __version__
from tests.e2e.conftest import CHAT_TEMPLATE, MODEL_NAME, ServerProcess

pytestmark = pytest.mark.e2e

PROMPTS = ["The quick brown fox", "0123456789", "naïve café jumps over"]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "The quick brown fox"},
]
GREEDY = {"temperature": 0.0}
BLOCK_SIZE = 16  # the server's default --block-size


# -- strict validation against the openai client's types ---------------------------------------


class _EchoLogprobs(Logprobs):
    # OpenAI's own API answers null for the first echoed prompt token; its types say float
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None


class _Choice(CompletionChoice):
    logprobs: _EchoLogprobs | None = None


class _StreamChoice(_Choice):
    # null until a choice's last chunk, as OpenAI streams it; the types share one class for both
    finish_reason: Literal["stop", "length", "content_filter"] | None = None


class _Completion(Completion):
    choices: list[_Choice]


class _CompletionChunk(Completion):
    choices: list[_StreamChoice]


def _extra_fields(value: Any, path: str) -> list[str]:
    """Paths of every field the types do not declare (the openai models keep them as extras)."""
    out: list[str] = []
    if isinstance(value, pydantic.BaseModel):
        out += [f"{path}.{k}" for k in value.__pydantic_extra__ or {}]
        for name in type(value).model_fields:
            out += _extra_fields(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _extra_fields(v, f"{path}[{i}]")
    return out


def strict(cls: type[pydantic.BaseModel], raw: dict[str, Any], allowed: tuple[str, ...] = ("stop_reason",)):
    """`cls.model_validate(raw)`, also refusing fields the type does not know (but `allowed`)."""
    obj = cls.model_validate(raw)
    unknown = [p for p in _extra_fields(obj, cls.__name__) if p.rsplit(".", 1)[-1] not in allowed]
    assert not unknown, f"fields unknown to the openai types: {unknown}"
    return obj


# -- helpers ------------------------------------------------------------------------------------


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def completion(server: ServerProcess, **body: Any) -> _Completion:
    return strict(_Completion, post(server, "/v1/completions", {"model": MODEL_NAME, **body}))


def chat(server: ServerProcess, **body: Any) -> ChatCompletion:
    return strict(ChatCompletion, post(server, "/v1/chat/completions", {"model": MODEL_NAME, **body}))


def sse(server: ServerProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The parsed `data:` events of a streamed request; checks the framing and the final [DONE]."""
    body = {"model": MODEL_NAME, **body, "stream": True}
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        text = r.read().decode()
        assert r.status_code == 200, text
        assert r.headers["content-type"].startswith("text/event-stream")
    events = text.split("\n\n")
    assert events[-1] == "", "the stream must end with a blank line"
    events = events[:-1]
    assert all(e.startswith("data: ") for e in events), events
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert not any("error" in p for p in payloads), payloads
    return payloads


def stream_completion(server: ServerProcess, **body: Any) -> list[_CompletionChunk]:
    return [strict(_CompletionChunk, p) for p in sse(server, "/v1/completions", body)]


def stream_chat(server: ServerProcess, **body: Any) -> list[ChatCompletionChunk]:
    return [strict(ChatCompletionChunk, p) for p in sse(server, "/v1/chat/completions", body)]


def joined(chunks: list, index: int = 0) -> tuple[str, list[str | None]]:
    """(the text of one choice of a completion stream, its finish reasons in order)."""
    mine = [c for chunk in chunks for c in chunk.choices if c.index == index]
    return "".join(c.text for c in mine), [c.finish_reason for c in mine if c.finish_reason]


def tokenize(server: ServerProcess, **body: Any) -> list[int]:
    out = post(server, "/tokenize", body)
    assert out["count"] == len(out["tokens"])
    return out["tokens"]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client()


# -- models, version, tokenizer -----------------------------------------------------------------


def test_models_and_version(server: ServerProcess, client: openai.OpenAI, tiny_model_dir: Path) -> None:
    assert [m.id for m in client.models.list()] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    listing = httpx.get(f"{server.url}/v1/models").json()
    assert listing["object"] == "list"
    extras = ("max_model_len", "state", "engine", "aliases", "size", "memory_bytes", "digest")
    card = strict(Model, listing["data"][0], allowed=extras)
    raw = listing["data"][0]
    assert card.id == MODEL_NAME and raw["max_model_len"] == 256
    assert raw["state"] == "loaded" and raw["engine"] == "native" and raw["aliases"] == []
    weights = sum(p.stat().st_size for p in tiny_model_dir.glob("*.safetensors"))
    assert raw["size"] == weights  # on disk, as Ollama's clients read a model's size
    assert raw["memory_bytes"] > weights  # the loaded weights (float32) and the KV cache
    assert raw["digest"] in (
        None,
        "sha256:" + hashlib.sha256((tiny_model_dir / "model.safetensors").read_bytes()).hexdigest(),
    )
    one = httpx.get(f"{server.url}/v1/models/{MODEL_NAME}").json()
    assert strict(Model, one, allowed=extras) == card
    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}


def test_tokenize_detokenize_round_trip(server: ServerProcess) -> None:
    for text in [*PROMPTS, "héllo 🙂 <|im_start|>"]:
        out = post(server, "/tokenize", {"prompt": text, "return_token_strs": True})
        assert out["count"] == len(out["tokens"]) == len(out["token_strs"]) > 0
        assert out["max_model_len"] == 256
        assert post(server, "/detokenize", {"tokens": out["tokens"]}) == {"prompt": text}
    strs = post(server, "/tokenize", {"prompt": "The quick", "return_token_strs": True})["token_strs"]
    assert "".join(strs) == "The quick"
    # messages go through the chat template, with the generation prompt by default
    ids = tokenize(server, messages=CHAT)
    rendered = post(server, "/detokenize", {"tokens": ids})["prompt"]
    assert rendered == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nThe quick brown fox<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert len(tokenize(server, messages=CHAT, add_generation_prompt=False)) < len(ids)


def test_tokenizer_info(server: ServerProcess) -> None:
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["vocab_size"] == 512 and info["model_max_length"] == 256
    assert info["eos_token"] == "<|endoftext|>" and info["eos_token_id"] == 0
    assert info["chat_template"] == CHAT_TEMPLATE


# -- completions --------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_stream_equals_full(server: ServerProcess, client: openai.OpenAI, prompt: str) -> None:
    full = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, **GREEDY)
    strict(_Completion, full.model_dump(exclude_unset=True))
    chunks = stream_completion(
        server, prompt=prompt, max_tokens=12, stream_options={"include_usage": True}, **GREEDY
    )
    text, reasons = joined(chunks[:-1])
    assert text == full.choices[0].text
    assert reasons == [full.choices[0].finish_reason]
    # usage: null on every chunk but the last, which has no choices
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # and through the openai client's own stream parser
    streamed = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=12, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text


def test_completion_usage_is_exact(server: ServerProcess) -> None:
    for prompt in PROMPTS:
        out = completion(server, prompt=prompt, max_tokens=7, logprobs=0, ignore_eos=True, **GREEDY)
        choice = out.choices[0]
        assert out.usage.prompt_tokens == len(tokenize(server, prompt=prompt))
        assert out.usage.completion_tokens == len(choice.logprobs.tokens) == 7
        assert out.usage.total_tokens == out.usage.prompt_tokens + 7
        assert choice.finish_reason == "length"


def test_cached_tokens_for_a_repeated_prompt(server: ServerProcess) -> None:
    rng = random.Random(0)
    # a unique first block, so nothing earlier in this module shares a prefix with it
    prompt = " ".join(str(rng.randrange(10**6)) for _ in range(8)) + " The quick brown fox." * 10
    num_prompt_tokens = len(tokenize(server, prompt=prompt))
    assert num_prompt_tokens > 4 * BLOCK_SIZE
    first = completion(server, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = completion(server, prompt=prompt, max_tokens=2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # whole blocks of the prompt are reused; the last prompt token is always computed again
    assert 0 < cached < num_prompt_tokens and cached % BLOCK_SIZE == 0
    chunks = stream_completion(server, prompt=prompt, max_tokens=2, stream_options={"include_usage": True})
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_n_choices_and_seeds(server: ServerProcess) -> None:
    body = dict(prompt="The quick", max_tokens=8, n=3, temperature=1.0, seed=7, ignore_eos=True)
    out = completion(server, **body)
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.text for c in out.choices]
    assert len(set(texts)) == 3, texts  # seeded samples of one request differ from each other
    assert [c.text for c in completion(server, **body).choices] == texts  # and are reproducible
    assert out.usage.completion_tokens == 3 * 8
    chunks = stream_completion(server, **body)
    assert [joined(chunks, i)[0] for i in range(3)] == texts
    assert all(joined(chunks, i)[1] == ["length"] for i in range(3))
    # one sample: the same seed gives the same text, another seed another text
    one = dict(prompt="The quick", max_tokens=12, temperature=1.0, ignore_eos=True)
    a, b = (completion(server, **one, seed=1234).choices[0].text for _ in range(2))
    assert a == b
    assert completion(server, **one, seed=4321).choices[0].text != a


def test_completion_logprobs(server: ServerProcess) -> None:
    k = 3
    out = completion(server, prompt="The quick brown", max_tokens=8, logprobs=k, ignore_eos=True, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    if not any("\ufffd" in t for t in lp.tokens):  # a partial UTF-8 character shows only joined
        assert "".join(lp.tokens) == out.choices[0].text
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0.0
        # the k best, plus the chosen token when it is not among them; strings may collide
        assert 1 <= len(top) <= k + 1 and token in top
        assert max(top.values()) <= chosen + 1e-5  # greedy: the chosen token is the most likely
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_completion_and_chat_logprobs_agree(server: ServerProcess) -> None:
    ids = tokenize(server, messages=CHAT)
    k = 5
    cmpl = completion(server, prompt=ids, max_tokens=6, logprobs=k, ignore_eos=True, **GREEDY)
    ch = chat(server, messages=CHAT, max_tokens=6, logprobs=True, top_logprobs=k, ignore_eos=True, **GREEDY)
    assert ch.usage.prompt_tokens == cmpl.usage.prompt_tokens == len(ids)
    assert ch.choices[0].message.content == cmpl.choices[0].text
    content = ch.choices[0].logprobs.content
    lp = cmpl.choices[0].logprobs
    assert [c.token for c in content] == lp.tokens
    assert [c.logprob for c in content] == pytest.approx(lp.token_logprobs, abs=1e-4)
    for c in content:
        assert len(c.top_logprobs) == k
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-5)  # greedy
        assert [t.logprob for t in c.top_logprobs] == sorted(
            (t.logprob for t in c.top_logprobs), reverse=True
        )
        assert c.bytes == list(c.token.encode())


def test_echo(server: ServerProcess) -> None:
    prompt = "The quick brown fox"
    num_prompt = len(tokenize(server, prompt=prompt))
    plain = completion(server, prompt=prompt, max_tokens=4, ignore_eos=True, **GREEDY).choices[0].text
    out = completion(server, prompt=prompt, max_tokens=4, echo=True, logprobs=1, ignore_eos=True, **GREEDY)
    choice = out.choices[0]
    assert choice.text == prompt + plain
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == num_prompt + 4
    assert "".join(lp.tokens[:num_prompt]) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes it
    assert all(x <= 0.0 for x in lp.token_logprobs[1:])
    assert lp.text_offset[num_prompt] == len(prompt)
    assert out.usage.completion_tokens == 4
    # streamed: the same text and logprobs, the prompt first
    chunks = stream_completion(
        server, prompt=prompt, max_tokens=4, echo=True, logprobs=1, ignore_eos=True, **GREEDY
    )
    assert joined(chunks)[0] == choice.text
    assert chunks[0].choices[0].text.startswith(prompt)
    streamed = [t for c in chunks for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs)


def test_echo_with_max_tokens_0_scores_the_prompt(server: ServerProcess) -> None:
    prompt = "naïve café jumps over"
    num_prompt = len(tokenize(server, prompt=prompt))
    out = completion(server, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    choice = out.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert len(choice.logprobs.token_logprobs) == num_prompt
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == num_prompt
    chunks = stream_completion(server, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    assert joined(chunks) == (prompt, ["length"])
    assert [t for c in chunks for t in c.choices[0].logprobs.token_logprobs] == pytest.approx(
        choice.logprobs.token_logprobs
    )


def test_echo_logprobs_match_transformers(server: ServerProcess, tiny_model_dir: Path) -> None:
    """Prompt logprobs against the same checkpoint in transformers: log_softmax of the previous
    position's logits at each prompt token."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for prompt in [PROMPTS[0], PROMPTS[2] + " " + PROMPTS[1]]:
        ids = tokenize(server, prompt=prompt)
        out = completion(server, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
        got = out.choices[0].logprobs.token_logprobs
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]  # [T, V]
        logp = torch.log_softmax(logits.float(), dim=-1)
        expected = [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert got[0] is None
        assert got[1:] == pytest.approx(expected, abs=1e-3)


def test_stop_strings(server: ServerProcess) -> None:
    base = dict(prompt="The quick brown", max_tokens=16, ignore_eos=True, **GREEDY)
    text = completion(server, **base).choices[0].text
    # a two-character stop string from the middle of the greedy text (not a partial UTF-8 char)
    start = next(i for i in range(3, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]
    expected = text[: text.find(stop)]
    for stops in ([stop], stop, ["never-generated", stop]):
        out = completion(server, **base, stop=stops)
        choice = out.choices[0]
        assert choice.text == expected and stop not in choice.text
        assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    chunks = stream_completion(server, **base, stop=[stop])
    assert joined(chunks) == (expected, ["stop"])
    assert chunks[-1].choices[0].model_extra["stop_reason"] == stop
    out = completion(server, **base, stop=[stop], include_stop_str_in_output=True)
    assert out.choices[0].text == expected + stop


def test_stop_token_ids(server: ServerProcess) -> None:
    base = dict(prompt="The quick brown", max_tokens=16, ignore_eos=True, logprobs=0, **GREEDY)
    tokens = completion(server, **base).choices[0].logprobs.tokens
    # a generated token that round-trips through the tokenizer alone, first at position j >= 1
    for j, s in enumerate(tokens):
        ids = tokenize(server, prompt=s)
        if j >= 1 and len(ids) == 1 and tokens.index(s) == j:
            break
    else:
        pytest.fail(f"no usable token in {tokens}")
    out = completion(server, **base, stop_token_ids=[ids[0]])
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == ids[0]
    assert choice.logprobs.tokens == tokens[: j + 1]  # the stop token is generated ...
    assert choice.text == "".join(tokens[:j])  # ... but not shown
    assert out.usage.completion_tokens == j + 1


def test_token_id_prompts_and_prompt_lists(server: ServerProcess) -> None:
    prompts = PROMPTS[:2]
    singles = [completion(server, prompt=p, max_tokens=6, **GREEDY).choices[0].text for p in prompts]
    ids = [tokenize(server, prompt=p) for p in prompts]
    assert completion(server, prompt=ids[0], max_tokens=6, **GREEDY).choices[0].text == singles[0]
    n = 2
    for prompt in (prompts, ids):
        out = completion(server, prompt=prompt, max_tokens=6, n=n, **GREEDY)
        # choice i * n + j is sample j of prompt i
        assert [c.index for c in out.choices] == list(range(len(prompts) * n))
        assert [c.text for c in out.choices] == [s for s in singles for _ in range(n)]
        assert out.usage.prompt_tokens == sum(len(x) for x in ids)
        chunks = stream_completion(server, prompt=prompt, max_tokens=6, n=n, **GREEDY)
        for i in range(len(prompts) * n):
            text, reasons = joined(chunks, i)
            assert text == singles[i // n] and len(reasons) == 1


def test_vllm_sampling_extras(server: ServerProcess) -> None:
    base = dict(prompt="The quick brown", max_tokens=8, ignore_eos=True)
    greedy = completion(server, **base, **GREEDY).choices[0].text
    assert completion(server, **base, temperature=1.0, top_k=1, seed=3).choices[0].text == greedy
    assert completion(server, **base, temperature=1.0, min_p=1.0, seed=3).choices[0].text == greedy
    # logit_bias +100 on one token makes it the only choice
    o = tokenize(server, prompt="o")[0]
    out = completion(server, **base, logit_bias={str(o): 100}, **GREEDY)
    assert out.choices[0].text == "o" * 8
    # EOS (id 0) forced by logit_bias ends at once; min_tokens holds it back that many tokens
    force_eos = dict(prompt="The quick brown", max_tokens=8, logit_bias={"0": 100}, **GREEDY)
    out = completion(server, **force_eos)
    assert out.usage.completion_tokens == 1 and out.choices[0].finish_reason == "stop"
    out = completion(server, **force_eos, min_tokens=3)
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "stop"
    out = completion(
        server, **base, repetition_penalty=1.3, top_p=0.9, presence_penalty=0.5, user="u-1", seed=5
    )
    assert out.usage.completion_tokens == 8


# -- chat ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("messages", [CHAT, [{"role": "user", "content": "0123456789"}]])
def test_chat_stream_equals_full(server: ServerProcess, client: openai.OpenAI, messages) -> None:
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, **GREEDY)
    strict(ChatCompletion, full.model_dump(exclude_unset=True))
    chunks = stream_chat(
        server, messages=messages, max_tokens=10, stream_options={"include_usage": True}, **GREEDY
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == full.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason]
    assert reasons == [full.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        full.usage.prompt_tokens,
        full.usage.completion_tokens,
    )
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt, a moment ago
    assert full.usage.prompt_tokens == len(tokenize(server, messages=messages))
    streamed = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=10, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == full.choices[0].message.content


def test_chat_stream_with_n(server: ServerProcess) -> None:
    chunks = stream_chat(server, messages=CHAT, max_tokens=6, n=2, temperature=1.0, seed=11, logprobs=True)
    texts = []
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert [c.delta.role for c in mine[1:]] == [None] * (len(mine) - 1)
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
        assert mine[-1].finish_reason == "length"  # nothing of a choice after its finish
        assert sum(len(c.logprobs.content) for c in mine if c.logprobs) == 6
        texts.append("".join(c.delta.content or "" for c in mine))
    full = chat(server, messages=CHAT, max_tokens=6, n=2, temperature=1.0, seed=11)
    assert [c.message.content for c in full.choices] == texts
    assert [c.index for c in full.choices] == [0, 1]


def test_chat_max_completion_tokens(server: ServerProcess) -> None:
    base = dict(messages=CHAT, ignore_eos=True, logprobs=True)
    assert chat(server, **base, max_completion_tokens=3).usage.completion_tokens == 3
    assert chat(server, **base, max_tokens=5).usage.completion_tokens == 5
    out = chat(server, **base, max_tokens=5, max_completion_tokens=2)  # the newer name wins
    assert out.usage.completion_tokens == len(out.choices[0].logprobs.content) == 2
    assert out.choices[0].finish_reason == "length"


def test_chat_text_parts_equal_string_content(server: ServerProcess) -> None:
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
        {"role": "user", "content": [{"type": "text", "text": "The quick brown fox"}]},
    ]
    assert tokenize(server, messages=parts) == tokenize(server, messages=CHAT)
    a = chat(server, messages=parts, max_tokens=6, **GREEDY)
    b = chat(server, messages=CHAT, max_tokens=6, **GREEDY)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_chat_all_roles(server: ServerProcess, client: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 6 times 7?"},
        {"role": "assistant", "content": "Let me compute."},
        {"role": "tool", "content": "42", "tool_call_id": "call-1"},
        {"role": "user", "content": "So?"},
    ]
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, user="u-2")
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(tokenize(server, messages=messages))
    rendered = post(server, "/detokenize", {"tokens": tokenize(server, messages=messages)})["prompt"]
    assert "<|im_start|>tool\n42<|im_end|>" in rendered


def test_a_whole_response_reads_one_output_and_a_stream_every_step(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A response sent whole (no `stream`) asks the engine for each request's final output only
    (no output built per step, the offline LLM's way); a streamed one for every step's delta. The
    app in this process (the real engine on the tiny model) with the engine's streams counted."""
    from fastapi.testclient import TestClient

    from llmserve.config import ServerConfig
    from llmserve.config.models import ModelSpec
    from llmserve.engine.async_engine import AsyncEngine, RequestStream
    from llmserve.server.app import build_app

    reads: list[list] = []  # [final_only, outputs the stream yielded] per request
    add, iterate = AsyncEngine.add_request, RequestStream._iterate

    def counted_add(self, *args, **kwargs):
        stream = add(self, *args, **kwargs)
        stream.read = [kwargs.get("final_only", False), 0]
        reads.append(stream.read)
        return stream

    async def counted_iterate(self):
        async for out in iterate(self):
            self.read[1] += 1
            yield out

    monkeypatch.setattr(AsyncEngine, "add_request", counted_add)
    monkeypatch.setattr(RequestStream, "_iterate", counted_iterate)
    body = {"model": MODEL_NAME, "max_tokens": 6, "ignore_eos": True, **GREEDY}
    with TestClient(build_app([ModelSpec(MODEL_NAME, str(tiny_model_dir))], ServerConfig())) as client:
        for path, extra in (
            ("/v1/completions", {"prompt": PROMPTS[0]}),
            ("/v1/chat/completions", {"messages": CHAT}),
        ):
            whole = client.post(path, json={**body, **extra}).json()
            assert (
                whole["usage"]["completion_tokens"] == 6 and whole["choices"][0]["finish_reason"] == "length"
            )
            assert client.post(path, json={**body, **extra, "stream": True}).text.endswith("data: [DONE]\n\n")
        # the other APIs' whole answers: Anthropic's Messages, Responses, Ollama's (stream: false)
        short = {"model": MODEL_NAME, "temperature": 0}
        for path, extra in (
            ("/v1/messages", {"max_tokens": 6, "messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/responses", {"max_output_tokens": 6, "input": "hi"}),
            ("/api/generate", {"prompt": "hi", "stream": False, "options": {"num_predict": 6}}),
            ("/api/generate", {"prompt": "hi", "options": {"num_predict": 6}}),  # (Ollama streams by default)
        ):
            assert client.post(path, json={**short, **extra}).status_code == 200
    # (how many deltas a stream reads depends on the load: a reader behind gets them merged)
    assert [final_only for final_only, _ in reads] == [True, False, True, False, True, True, True, False]
    assert [n for final_only, n in reads if final_only] == [1] * 5


def test_a_stream_interval_sends_tokens_in_groups_and_the_same_text(tiny_model_dir: Path) -> None:
    """A model served with `stream_interval` 4: a streamed completion's chunks carry its first
    token, then four at a time (fewer when a reader behind gets them merged: more, never fewer),
    and together the text of the same request answered whole."""
    from fastapi.testclient import TestClient

    from llmserve.config import ServerConfig
    from llmserve.config.models import ModelSpec
    from llmserve.server.app import build_app

    spec = ModelSpec(MODEL_NAME, str(tiny_model_dir), options={"stream_interval": 4})
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPTS[1],
        "max_tokens": 9,
        "ignore_eos": True,
        "logprobs": 0,
        **GREEDY,
    }
    with TestClient(build_app([spec], ServerConfig())) as client:
        whole = client.post("/v1/completions", json=body).json()["choices"][0]
        lines = client.post("/v1/completions", json={**body, "stream": True}).text.splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    counts = [len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"][0]["logprobs"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert sum(counts) == 9 and counts[0] in (1, 5, 9) and all(n >= 4 for n in counts[1:]), counts
