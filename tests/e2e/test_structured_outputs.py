"""Structured outputs over HTTP: OpenAI's `response_format` through the `openai` client
(`chat.completions.parse` with pydantic models, streamed and not), vLLM's `structured_outputs` and
`guided_*` fields on completions, and every malformed constraint answered with a 400 naming its
field while the server keeps serving. The model is a tiny random Llama: only the grammar can make
its output valid."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import pydantic
import pytest
from openai.types.chat import ChatCompletionChunk

from tests.e2e.conftest import MODEL_NAME, ServerProcess
from tests.models.test_structured_outputs import closed_schema

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "The quick brown fox"}]


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog", "fish"]
    legs: int = pydantic.Field(ge=0, le=4)
    name: str = pydantic.Field(max_length=6)


class Owner(pydantic.BaseModel):
    first_pet: Pet
    likes_pets: bool


@pytest.mark.parametrize("model", [Pet, Owner])
def test_parse_with_pydantic_models(so_server: ServerProcess, model: type[pydantic.BaseModel]) -> None:
    client = so_server.client()
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=MODEL_NAME,
            messages=MESSAGES,
            response_format=model,
            seed=seed,
            temperature=1.0,
            max_tokens=200,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, model)
        assert choice.message.parsed == model.model_validate_json(choice.message.content or "")


def test_streamed_json_schema_and_json_object(so_server: ServerProcess) -> None:
    schema = closed_schema(Pet.model_json_schema())  # what strict mode sends
    body = {
        "model": MODEL_NAME, "messages": MESSAGES, "stream": True, "seed": 4, "temperature": 1.0, "max_tokens": 200,
        "response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}},
    }  # fmt: skip
    text, finish = "", None
    with httpx.stream("POST", f"{so_server.url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = ChatCompletionChunk.model_validate_json(line[6:])
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_vllm_fields_on_completions(so_server: ServerProcess) -> None:
    client = so_server.client()
    cases = [
        ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        ({"guided_regex": r"x{2,4}y"}, lambda t: re.fullmatch(r"x{2,4}y", t)),
        ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2}},
         lambda t: isinstance(json.loads(t), list)),
        ({"guided_grammar": 'start: "a" "b"+'}, lambda t: re.fullmatch("ab+", t)),
    ]  # fmt: skip
    for extra, ok in cases:
        r = client.completions.create(
            model=MODEL_NAME,
            prompt="The quick",
            max_tokens=40,
            temperature=1.0,
            seed=1,
            n=2,
            extra_body=extra,
        )
        for choice in r.choices:
            assert ok(choice.text) and choice.finish_reason == "stop", (extra, choice.text)


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
      "response_format", "invalid structured_outputs.json"),
     ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "needs json_schema.schema"),
     ({"response_format": {"type": "xml"}}, "response_format", ""),
     ({"guided_regex": "(open"}, "guided_regex", "invalid structured_outputs.regex"),
     ({"guided_grammar": "start: nowhere"}, "guided_grammar", "invalid structured_outputs.grammar"),
     ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
     ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
     ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice", "give one structured-output constraint")],
)  # fmt: skip
def test_bad_constraints_are_400s_naming_the_field(so_server: ServerProcess, extra, param, message) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 5, **extra}
    r = httpx.post(f"{so_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"]
    assert error["param"] == param or (
        param == "response_format" and "response_format" in str(error["param"])
    )
    ok = httpx.post(
        f"{so_server.url}/v1/chat/completions", json={**body, **{k: None for k in extra}}, timeout=60
    )
    assert ok.status_code == 200, ok.text  # the server keeps serving
