"""Fuzzing a running server with OpenAI's own API description (`../shared/openai/openapi.yaml`):
schemathesis generates requests for the operations llmserve serves, valid ones (by OpenAI's schemas)
and invalid ones, and every response is checked:

  - never a 5xx;
  - every error (4xx) is OpenAI-shaped: `{"error": {"message": str, "type": str, "param", "code"}}`;
  - a 200 for a request that is invalid by OpenAI's schema is allowed (llmserve accepts some
    extensions and lenient forms), but a 200 body must be JSON (or an SSE stream that ends with
    `data: [DONE]`) in the response's declared shape where the spec declares one;
  - afterwards the server still answers /health and a plain request.

The model field is set to the served model's name in three requests of four (a random name stops
at the model check, a 404, and would test little else). As a script, a longer run:

    python -m tests.e2e.fuzz_openapi [--model MODEL] [--max-examples 300] [--seed 0] [--url URL]

starts `llmserve serve` on the tiny test model (or uses `--url`) and prints a summary per operation.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from schemathesis import GenerationMode

SPEC = Path(__file__).resolve().parents[2].parent / "shared" / "openai" / "openapi.yaml"
SERVED = {
    ("POST", "/chat/completions"),
    ("POST", "/completions"),
    ("POST", "/embeddings"),
    ("GET", "/models"),
    ("GET", "/models/{model}"),
}


@dataclass
class Findings:
    """What a fuzzing run saw: status codes per operation and the requests that broke a rule."""

    statuses: dict[str, Counter] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"{op}: {dict(sorted(c.items()))}" for op, c in sorted(self.statuses.items())]
        lines.append(f"{len(self.problems)} problem(s)")
        lines += self.problems[:20]
        return "\n".join(lines)


def load_schema(spec: Path = SPEC):
    schema = schemathesis.openapi.from_path(spec)
    return schema.include(lambda ctx: (ctx.operation.method.upper(), ctx.operation.path) in SERVED)


def error_shape_problem(body: object) -> str | None:
    """Why `body` is not an OpenAI error object (None when it is one)."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return "no error object"
    err = body["error"]
    if not isinstance(err.get("message"), str) or not err["message"]:
        return "error.message is not a non-empty string"
    if not isinstance(err.get("type"), str):
        return "error.type is not a string"
    if "param" not in err or "code" not in err:
        return "error lacks param or code"
    return None


def check_response(status: int, content_type: str, text: str, streamed: bool) -> str | None:
    """The rule a response breaks, if any."""
    if status >= 500:
        return f"server error {status}: {text[:300]}"
    if status >= 400:
        try:
            body = json.loads(text)
        except ValueError:
            return f"{status} with a body that is not JSON: {text[:200]}"
        problem = error_shape_problem(body)
        return f"{status}: {problem}: {text[:200]}" if problem else None
    if streamed and content_type.startswith("text/event-stream"):
        # split on "\n" only: str.splitlines() also breaks at U+0085 and U+2028, which JSON leaves as is
        events = [line[6:].rstrip("\r") for line in text.split("\n") if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return f"stream does not end with [DONE]: {text[-200:]}"
        for event in events[:-1]:
            try:
                value = json.loads(event)
            except ValueError:
                return f"stream event is not JSON: {event[:200]}"
            if "error" in value and (problem := error_shape_problem(value)):
                return f"stream error event: {problem}"
        return None
    try:
        json.loads(text)
    except ValueError:
        return f"{status} body is not JSON: {text[:200]}"
    return None


def fuzz(base_url: str, model: str, max_examples: int, seed: int = 0, schema=None) -> Findings:
    """Run every served operation's generated cases (positive and negative) against `base_url`
    (the server's root, without /v1)."""
    schema = schema or load_schema()
    findings = Findings()
    counter = itertools.count()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz_operation(operation, mode, base_url, model, max_examples, seed, counter, findings)
    return findings


def _fuzz_operation(operation, mode, base_url, model, max_examples, seed, counter, findings) -> None:
    label = f"{operation.method.upper()} {operation.path}"
    statuses = findings.statuses.setdefault(label, Counter())

    @given(case=operation.as_strategy(generation_mode=mode))
    @hypothesis_seed(seed)
    @settings(max_examples=max_examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])  # fmt: skip
    def one(case) -> None:
        n = next(counter)
        body = case.body
        if isinstance(body, dict) and "model" in body and n % 4:
            body["model"] = model
        if case.path_parameters and "model" in case.path_parameters and n % 4:
            case.path_parameters["model"] = model
        streamed = isinstance(body, dict) and body.get("stream") is True
        # sent with requests itself: schemathesis' own call keeps only part of a long stream
        try:
            response = requests.request(**case.as_transport_kwargs(base_url=f"{base_url}/v1"), timeout=120)
        except requests.RequestException as e:  # the server hung up or timed out
            findings.problems.append(f"{label} [{mode.value}]: transport error {e!r}")
            return
        statuses[response.status_code] += 1
        text = response.content.decode("utf-8", errors="replace")
        problem = check_response(
            response.status_code, response.headers.get("content-type", ""), text, streamed
        )
        if problem:
            shown = json.dumps(body, default=repr)
            findings.problems.append(f"{label} [{mode.value}] {shown} -> {problem}")

    one()


def still_serving(base_url: str, model: str) -> str | None:
    """Why the server is no longer serving after a run (None when it is)."""
    health = httpx.get(f"{base_url}/health", timeout=30)
    if health.status_code != 200:
        return f"/health answers {health.status_code}"
    r = httpx.post(
        f"{base_url}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 4}, timeout=60
    )
    if r.status_code != 200 or not r.json()["choices"]:
        return f"a plain completion answers {r.status_code}: {r.text[:200]}"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="fuzz a running server (its root URL) instead of starting one")
    ap.add_argument("--model", default="tiny-llama", help="the served model name")
    ap.add_argument("--max-examples", type=int, default=300, help="per operation and generation mode")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    proc = None
    if args.url is None:
        from tests.e2e.conftest import CHAT_TEMPLATE, ServerProcess
        from tests.models.tiny import make_tiny_model

        folder = Path(tempfile.mkdtemp(prefix="llmserve-fuzz-"))
        make_tiny_model("llama", folder)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
        proc = ServerProcess(folder).start()
        args.url, args.model = proc.url, "tiny-llama"
    try:
        findings = fuzz(args.url, args.model, args.max_examples, args.seed)
        print(findings.summary())
        broken = still_serving(args.url, args.model)
        print(broken or "still serving afterwards")
    finally:
        if proc is not None:
            proc.stop()
    return 1 if findings.problems or broken else 0


if __name__ == "__main__":
    sys.exit(main())
