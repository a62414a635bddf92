"""`--otlp-traces-endpoint` wiring without a model: the trace-context middleware and the tracer
provider exist only with the flag (no tracing cost without it), and bad values are refused.
tests/e2e/test_tracing.py checks the spans themselves against a real collector."""

from __future__ import annotations

import pytest

from llmserve.cli.main import build_parser
from llmserve.cli.serve import server_config
from llmserve.config import ServerConfig
from llmserve.config.models import ModelSpec
from llmserve.server.app import build_app
from llmserve.server.middleware import TraceContext


def _middleware(app) -> list[type]:
    return [m.cls for m in app.user_middleware]


def test_no_tracing_without_the_flag():
    app = build_app([ModelSpec(name="m", source="unused")], ServerConfig())
    assert TraceContext not in _middleware(app)
    assert app.state.server.models.tracer_provider is None


def test_the_flag_installs_the_context_middleware_and_a_provider():
    config = server_config(build_parser().parse_args(["serve", "--otlp-traces-endpoint", "127.0.0.1:4317"]))
    assert config.otlp_traces_endpoint == "127.0.0.1:4317"
    app = build_app([ModelSpec(name="m", source="unused")], config)
    assert TraceContext in _middleware(app)
    provider = app.state.server.models.tracer_provider
    assert provider is not None
    provider.shutdown()


def test_an_empty_endpoint_is_refused():
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        ServerConfig(otlp_traces_endpoint="")
