"""`llmserve serve --speculative-config` on the embedded model: streamed and whole answers agree,
vLLM's speculative-decoding counters appear in /metrics, and the periodic log line reports the
acceptance rate."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess
from tests.e2e.test_models import metric, samples

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
    "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889."
)


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    proc = ServerProcess(
        "smollm2-135m-instruct", "--speculative-config", config, "--stats-log-interval", "0.5",
        log_dir=tmp_path_factory.mktemp("spec-server"),
    ).start()  # fmt: skip
    yield proc
    proc.stop()


def test_speculative_server(spec_server: ServerProcess) -> None:
    client = spec_server.client()
    messages = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{TEXT}"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=60, temperature=0)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=60, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == whole.choices[0].message.content and "Eiffel" in streamed
    m = "llmserve:spec_decode_"
    drafts, proposed = (
        metric(spec_server, f"{m}num_drafts_total"),
        metric(spec_server, f"{m}num_draft_tokens_total"),
    )
    accepted = metric(spec_server, f"{m}num_accepted_tokens_total")
    assert drafts > 0 and proposed >= drafts and 0 < accepted <= proposed
    per_pos = {
        dict(k)["position"]: v
        for k, v in samples(spec_server, f"{m}num_accepted_tokens_per_pos_total").items()
    }
    assert sum(per_pos.values()) == accepted and per_pos["0"] >= per_pos.get("3", 0)
    deadline = time.monotonic() + 10
    while "speculation:" not in spec_server.log():
        assert time.monotonic() < deadline, spec_server.log()
        time.sleep(0.2)
    r = httpx.get(f"{spec_server.url}/health")
    assert r.status_code == 200
