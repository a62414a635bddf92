"""A bounded fuzzing run against the real server on the tiny model, with OpenAI's own API
description (`../shared/openai/openapi.yaml`): no response is a 5xx, every error body is
OpenAI-shaped, streams end with `data: [DONE]`, and the server is still serving afterwards.
`python -m tests.e2e.fuzz_openapi` runs the same for longer (see that module)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess
from tests.e2e.fuzz_openapi import SPEC, check_response, error_shape_problem, fuzz, load_schema, still_serving

pytestmark = pytest.mark.e2e


def test_fuzzing_with_openais_spec_finds_no_server_error(server: ServerProcess) -> None:
    assert SPEC.is_file(), f"OpenAI's API description missing: {SPEC} (the repo expects ../shared beside it)"
    schema = load_schema()
    served = {(r.ok().method.upper(), r.ok().path) for r in schema.get_all_operations()}
    assert served == {("POST", "/chat/completions"), ("POST", "/completions"), ("POST", "/embeddings"),
                      ("GET", "/models"), ("GET", "/models/{model}")}  # fmt: skip
    findings = fuzz(server.url, MODEL_NAME, max_examples=25, seed=0, schema=schema)
    assert not findings.problems, findings.summary()
    chat = findings.statuses["POST /chat/completions"]
    assert chat[200] > 0 and chat[400] > 0, findings.summary()  # valid and invalid requests both reached it
    assert still_serving(server.url, MODEL_NAME) is None


def test_the_checks_catch_what_they_should() -> None:
    """The rules themselves, on responses that break them."""
    assert check_response(500, "application/json", '{"error": {"message": "x"}}', False).startswith(
        "server error"
    )
    assert "not JSON" in check_response(400, "text/plain", "Bad Request", False)
    assert error_shape_problem({"detail": "x"}) == "no error object"
    assert error_shape_problem({"error": {"message": "m", "type": "t"}}) == "error lacks param or code"
    good = '{"error": {"message": "m", "type": "invalid_request_error", "param": null, "code": null}}'
    assert check_response(400, "application/json", good, False) is None
    cut = 'data: {"choices": []}\n\n'
    assert "[DONE]" in check_response(200, "text/event-stream", cut, True)
    line_sep = 'data: {"choices": [{"text": "a\u2028b"}]}\n\ndata: [DONE]\n\n'
    assert check_response(200, "text/event-stream; charset=utf-8", line_sep, True) is None
