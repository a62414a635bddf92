"""The direct front's router keys the raw request body (`PrefixKeyer.body_key`) without the
request's pydantic model: on every body routing depends on, its key is the key of the validated
request (`completion_key` / `chat_key`, themselves checked against transformers' tokenizer and
chat template in test_ray_serve_routing.py), and a body it cannot key (None) goes by load.
The head cache gives the same keys as encoding afresh; the router's plain ASGI route answers as
HAProxy's Lua reads it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import transformers

pytest.importorskip("ray.serve")

from pydantic import ValidationError
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import DeploymentUnavailableError

from llmserve.ray_serve.direct import PrefixRouter
from llmserve.ray_serve.prefix import PrefixKeyer
from llmserve.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.unit.test_ray_serve_routing import (  # noqa: F401 (fixtures: 3 blocks of 16)
    BLOCK,
    engine_hash,
    keyer,
    model_dir,
)

LONG = "The quick brown fox jumps over the lazy dog. " * 6
SYSTEM = "You answer questions about geography, briefly. " * 3
IDS = list(range(3, 60))


def validated_key(prefix_keyer: PrefixKeyer, data: Any) -> int | None:
    """The key of the request the replica validates (the ingress's path); None where it is not a
    prompt route's valid request."""
    if not isinstance(data, dict):
        return None
    try:
        if "messages" in data:
            return prefix_keyer.chat_key(ChatCompletionRequest.model_validate(data))
        if "prompt" in data:
            return prefix_keyer.completion_key(CompletionRequest.model_validate(data))
    except ValidationError:
        return None
    return None


def chat(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), **fields}


def system(content: Any = SYSTEM) -> dict[str, Any]:
    return {"role": "system", "content": content}


USER = {"role": "user", "content": "Where is Lima?"}

KEYED = {
    "completion text": {"model": "m", "prompt": LONG, "max_tokens": 1},
    "completion token ids": {"model": "m", "prompt": IDS},
    "a batch of texts": {"model": "m", "prompt": [LONG, "another prompt"]},
    "a batch of token id lists": {"model": "m", "prompt": [IDS, [1, 2, 3]]},
    "chat": chat(system(), USER),
    "chat without the generation prompt": chat(system(), USER, add_generation_prompt=False),
    "chat, every role": chat(
        system(),
        {"role": "developer", "content": "Be kind."},
        USER,
        {"role": "assistant", "content": "In Peru."},
        {"role": "tool", "content": "{}"},
    ),
    # not plain: through the request's model, as the replica renders it
    "chat with text parts": chat(system([{"type": "text", "text": SYSTEM}]), USER),
    "chat with a name": chat({**system(), "name": "guide"}, USER),
    "chat with a null content": chat(system(None), USER),
    "chat with an unknown field": chat({**system(), "x-note": 1}, USER),
}
"""Bodies with a key: body_key must give the validated request's."""

UNKEYED = {
    "a short prompt": {"model": "m", "prompt": "Hi"},
    "an empty batch": {"model": "m", "prompt": []},
    "token ids as booleans": {"model": "m", "prompt": [True] * 40},
    "token ids as floats": {"model": "m", "prompt": [float(t) for t in IDS]},
    "a mixed batch": {"model": "m", "prompt": [LONG, IDS]},
    "a prompt object": {"model": "m", "prompt": {"text": LONG}},
    "messages as text": {"model": "m", "messages": LONG},
    "an unknown role": chat({"role": "narrator", "content": SYSTEM}, USER),
    "a non-boolean generation prompt flag": chat(system(), USER, add_generation_prompt="yes"),
    "an embeddings body": {"model": "m", "input": LONG},
    "a JSON list": [1, 2, 3],
}
"""Bodies without a key (routed by load): the validated request has none either."""


@pytest.mark.parametrize("name", list(KEYED))
def test_body_key_is_the_validated_requests_key(keyer: PrefixKeyer, name: str) -> None:  # noqa: F811
    data = KEYED[name]
    expected = validated_key(keyer, data)
    assert expected is not None
    assert keyer.body_key(json.dumps(data).encode()) == expected


@pytest.mark.parametrize("name", list(UNKEYED))
def test_bodies_without_a_key_go_by_load(keyer: PrefixKeyer, name: str) -> None:  # noqa: F811
    data = UNKEYED[name]
    assert validated_key(keyer, data) is None
    assert keyer.body_key(json.dumps(data).encode()) is None


@pytest.mark.parametrize(
    "body", [b"", b"{not json", b"\xff\xfe", json.dumps(KEYED["chat"]).encode()[:60]], ids=repr
)
def test_a_body_that_is_not_json_goes_by_load(keyer: PrefixKeyer, body: bytes) -> None:  # noqa: F811
    """Not JSON, not UTF-8, or cut short (HAProxy's buffer)."""
    assert keyer.body_key(body) is None


def test_body_key_against_transformers(model_dir, keyer: PrefixKeyer) -> None:  # noqa: F811
    """The reference itself: transformers' chat template and tokenizer, then the engine's hash."""
    reference = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [system(), USER]
    ids = reference.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert keyer.body_key(json.dumps(chat(*messages)).encode()) == engine_hash(list(ids), 3)
    text_ids = reference(LONG)["input_ids"]
    assert keyer.body_key(json.dumps(KEYED["completion text"]).encode()) == engine_hash(text_ids, 3)


def test_a_body_invalid_elsewhere_keeps_its_prompts_key(keyer: PrefixKeyer) -> None:  # noqa: F811
    """Only the prompt is checked: the replica refuses the rest, wherever the body goes."""
    body = {"model": "m", "prompt": LONG, "max_tokens": "many"}
    assert validated_key(keyer, body) is None
    assert keyer.body_key(json.dumps(body).encode()) == keyer.text_key(LONG)


def test_the_head_cache_gives_fresh_keys(keyer: PrefixKeyer) -> None:  # noqa: F811
    fresh = PrefixKeyer(keyer.tokenizer, BLOCK, keyer.num_blocks)
    for tail in ("", " and more", " other words entirely"):
        text = LONG * 4 + tail  # longer than the head: one cached head for all three
        assert keyer.text_key(text) == fresh._encoded_key(text[: 3 * BLOCK * 16], True)
    before = keyer._head_key.cache_info().hits
    keyer.text_key(LONG * 4)
    assert keyer._head_key.cache_info().hits == before + 1
    # the special tokens flag is part of the cached key
    assert keyer.text_key(LONG, add_special_tokens=False) == fresh._encoded_key(LONG, False)


def route(router: PrefixRouter, method: str, path: str, body: bytes) -> tuple[int, bytes]:
    """One ASGI call of the router's app, as Serve's HTTP server makes it: (status, body)."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": [], "query_string": b""}
    asyncio.run(router.__serve_build_asgi_app__()(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.filterwarnings("ignore:coroutine .*ASGIIngressWrapper.__del__:RuntimeWarning")
def test_the_routers_answer_is_what_haproxys_lua_reads(keyer: PrefixKeyer) -> None:  # noqa: F811
    """200 with {"replica_id": the pick for the body's key}; another route 404; no replica 503
    (HAProxy's Lua takes any non-200 as the router failing)."""
    picked: list[int | None] = []

    async def pick(key: int | None) -> str:
        picked.append(key)
        if key is None and len(picked) > 2:
            raise DeploymentUnavailableError(DeploymentID("EngineReplica", "llmserve"))
        return "SERVE_REPLICA::llmserve#EngineReplica#abc"

    router = PrefixRouter.__new__(PrefixRouter)  # no Ray: the keyer and a stand-in pick
    router.keyer, router.pick = keyer, pick
    body = json.dumps(KEYED["chat"]).encode()
    status, answer = route(router, "POST", "/internal/route", body)
    assert status == 200 and json.loads(answer) == {"replica_id": "SERVE_REPLICA::llmserve#EngineReplica#abc"}
    assert picked == [keyer.body_key(body)]
    assert route(router, "POST", "/internal/route", b"{}")[0] == 200  # no key: by load
    assert route(router, "GET", "/internal/route", b"")[0] == 404
    assert route(router, "POST", "/v1/completions", body)[0] == 404
    status, answer = route(router, "POST", "/internal/route", b"not json")
    assert status == 503 and b"EngineReplica" in answer
