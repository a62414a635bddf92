"""The Files and Batches APIs end to end with the `openai` client: a batch's bodies equal the
online endpoint's, a bad line lands in the error file, cancel, list, a SIGKILL mid-batch resumed
without losing or repeating a line, `llmserve run-batch` on the same file, and bad requests."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"


def chat_line(i: int, max_tokens: int = 8) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    return {"custom_id": f"chat-{i}", "method": "POST", "url": CHAT, "body": body}


def cmpl_line(i: int) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "prompt": f"once upon a time {i}", "max_tokens": 8, "temperature": 0}
    return {"custom_id": f"cmpl-{i}", "method": "POST", "url": CMPL, "body": body}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def comparable(body: dict[str, Any]) -> dict[str, Any]:
    """A response without what differs between two runs of one request: ids, time, cache hits."""
    out = {k: v for k, v in body.items() if k not in ("id", "created")}
    out["usage"] = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    return out


def run_batch(client: openai.OpenAI, lines: list[dict[str, Any]], endpoint: str, timeout: float = 120):
    file = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint=endpoint, completion_window="24h",
                                  metadata={"test": "yes"})  # fmt: skip
    assert batch.status == "validating" and batch.metadata == {"test": "yes"}
    return wait(client, batch.id, timeout)


def wait(client: openai.OpenAI, batch_id: str, timeout: float = 120, until: tuple[str, ...] = ("completed",)):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in (*until, "failed", "expired", "cancelled", "completed"):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout} s")


def results(client: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    if file_id is None:
        return {}
    lines = [json.loads(x) for x in client.files.content(file_id).text.splitlines()]
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "a custom_id repeats"
    return by_id


@pytest.fixture(scope="module")
def batch_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("batches")
    proc = ServerProcess(tiny_model_dir, "--batch-dir", str(folder)).start()
    yield proc
    proc.stop()


def test_batch_bodies_equal_online_and_bad_line_goes_to_error_file(batch_server: ServerProcess) -> None:
    client = batch_server.client()
    bad = {"custom_id": "bad", "method": "POST", "url": CHAT, "body": {"messages": "not a list"}}
    lines = [chat_line(i) for i in range(4)] + [bad]
    batch = run_batch(client, lines, CHAT)
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 5 and batch.request_counts.completed == 4
    assert batch.request_counts.failed == 1
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    out, err = results(client, batch.output_file_id), results(client, batch.error_file_id)
    assert sorted(out) == [f"chat-{i}" for i in range(4)] and list(err) == ["bad"]
    assert err["bad"]["response"]["status_code"] == 400
    assert err["bad"]["response"]["body"]["error"]["type"] == "invalid_request_error"
    for line in lines[:4]:
        online = client.chat.completions.create(**line["body"]).model_dump(exclude_unset=True)
        got = out[line["custom_id"]]["response"]
        assert got["status_code"] == 200
        assert comparable(got["body"]) == comparable(json.loads(json.dumps(online)))

    cmpl = [cmpl_line(i) for i in range(4)]
    batch = run_batch(client, cmpl, CMPL)
    assert batch.status == "completed" and batch.error_file_id is None
    out = results(client, batch.output_file_id)
    for line in cmpl:
        online = client.completions.create(**line["body"]).model_dump(exclude_unset=True)
        assert comparable(out[line["custom_id"]]["response"]["body"]) == comparable(online)


def test_embedding_lines_equal_online_embeddings(batch_server: ServerProcess) -> None:
    """`/v1/embeddings` lines (text, several texts, token ids): the online endpoint's vectors (to
    float rounding: a line may share its forward pass with another) and usage."""
    client = batch_server.client()
    inputs = ["once upon a time", ["the lazy dog", "a quick brown fox"], [5, 17, 99, 3]]
    lines = [
        {
            "custom_id": f"emb-{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": MODEL_NAME, "input": x},
        }
        for i, x in enumerate(inputs)
    ]
    batch = run_batch(client, lines, "/v1/embeddings")
    assert batch.status == "completed" and batch.request_counts.completed == 3, batch
    out = results(client, batch.output_file_id)
    for i, x in enumerate(inputs):
        got = out[f"emb-{i}"]["response"]
        assert got["status_code"] == 200
        online = client.embeddings.create(model=MODEL_NAME, input=x).model_dump()
        assert got["body"]["usage"] == online["usage"] and len(got["body"]["data"]) == len(online["data"])
        for a, b in zip(got["body"]["data"], online["data"], strict=True):
            dot = sum(p * q for p, q in zip(a["embedding"], b["embedding"], strict=True))
            assert a["index"] == b["index"] and dot > 0.99999  # both normalised: the cosine


def test_cancel_and_list(batch_server: ServerProcess) -> None:
    client = batch_server.client()
    file = client.files.create(
        file=("in.jsonl", jsonl([chat_line(i, 64) for i in range(40)])), purpose="batch"
    )
    batch = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at
    batch = wait(client, batch.id, until=("cancelled",))
    assert batch.status == "cancelled" and batch.cancelled_at
    assert batch.request_counts.completed + batch.request_counts.failed < 40
    page = client.batches.list(limit=1)
    assert [b.id for b in page.data] == [batch.id] and page.has_more  # newest first
    after = client.batches.list(limit=100, after=batch.id)
    assert batch.id not in [b.id for b in after.data] and after.data
    assert file.id in [f.id for f in client.files.list().data]
    assert client.files.delete(file.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file.id)


def test_bad_requests(batch_server: ServerProcess) -> None:
    client = batch_server.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")
    assert e.value.body["code"] == "file_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("in.jsonl", b"{}\n"), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    file = client.files.create(file=("in.jsonl", jsonl([chat_line(0)])), purpose="batch")
    for endpoint, window in (("/v1/moderations", "24h"), ("/v1/responses", "24h"), (CHAT, "1h")):
        with pytest.raises(openai.BadRequestError):
            client.batches.create(input_file_id=file.id, endpoint=endpoint, completion_window=window)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    # a line for another endpoint fails the batch's validation, with the line's number
    bad = client.files.create(file=("in.jsonl", jsonl([chat_line(0), cmpl_line(0)])), purpose="batch")
    batch = wait(
        client, client.batches.create(input_file_id=bad.id, endpoint=CHAT, completion_window="24h").id
    )
    assert batch.status == "failed" and batch.failed_at
    assert batch.errors.data[0].line == 2 and batch.errors.data[0].code == "invalid_url"


def test_sigkill_mid_batch_resumes_without_losing_or_repeating(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ("--batch-dir", str(tmp_path / "batches"), "--batch-max-concurrency", "1")
    lines = [chat_line(i, 48) for i in range(12)]
    proc = ServerProcess(tiny_model_dir, *args).start()
    try:
        client = proc.client()
        file = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
        deadline = time.monotonic() + 60
        while client.batches.retrieve(batch.id).request_counts.completed < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        proc.stop(signal.SIGKILL)
    proc = ServerProcess(tiny_model_dir, *args).start()
    try:
        client = proc.client()
        batch = wait(client, batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 12
        content = client.files.content(batch.output_file_id).text.splitlines()
        ids = [json.loads(x)["custom_id"] for x in content]
        assert sorted(ids) == sorted(line["custom_id"] for line in lines)  # each exactly once
        # a second server on the same folder would run the same lines again: it serves no batches
        second = ServerProcess(tiny_model_dir, *args).start()
        try:
            with pytest.raises(openai.InternalServerError) as e:
                second.client(max_retries=0).batches.list()
            assert e.value.status_code == 503 and e.value.body["code"] == "batch_dir_unavailable"
        finally:
            second.stop()
    finally:
        proc.stop()


def test_run_batch_cli_gives_the_servers_bodies(
    batch_server: ServerProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    client = batch_server.client()
    lines = [chat_line(i) for i in range(3)]
    served = results(client, run_batch(client, lines, CHAT).output_file_id)
    mixed = [*lines, cmpl_line(0)]
    (tmp_path / "in.jsonl").write_bytes(jsonl(mixed))
    cmd = [sys.executable, "-m", "llmserve.cli.main", "--log-level", "WARNING", "run-batch",
           "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--model", str(tiny_model_dir),
           "--served-model-name", MODEL_NAME, "--num-kv-blocks", "256"]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    offline = {x["custom_id"]: x for x in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert sorted(offline) == sorted(line["custom_id"] for line in mixed)
    for line in lines:
        assert comparable(offline[line["custom_id"]]["response"]["body"]) == comparable(
            served[line["custom_id"]]["response"]["body"]
        )
    assert offline["cmpl-0"]["response"]["body"]["object"] == "text_completion"
