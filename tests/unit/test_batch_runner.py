"""`BatchRunner` on a fake model manager (no model): the status walk, bad lines, expiry, resume
after a crash without repeating a line, and the bound on lines in flight."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse

from llmserve.server.batches.lines import result_line
from llmserve.server.batches.runner import BatchRunner
from llmserve.server.batches.store import BatchStore

CHAT = "/v1/chat/completions"


class FakeModels:
    """What the runner and `run_line` use of `ModelManager`: each request answers its first
    message's content back, after `delay` seconds."""

    def __init__(self, delay: float = 0.0, num_online: int = 0) -> None:
        self.started_up, self.closed = True, False
        self.delay, self.num_online = delay, num_online
        self.in_flight = self.max_in_flight = self.calls = 0

    @property
    def num_active(self) -> int:
        return self.in_flight + self.num_online

    async def serve(self, name: Any, remote: Any, native: Any) -> JSONResponse:
        self.in_flight += 1
        self.calls += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        return JSONResponse({"id": "chatcmpl-1", "echo": "ok"})


def line(i: int, body: Any = None) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": str(i)}]} if body is None else body
    return {"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": body}


def submit(runner: BatchRunner, lines: list[dict[str, Any]]) -> str:
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    file = runner.store.add_file("in.jsonl", "batch", data)
    return runner.create(file["id"], CHAT, "24h", None)["id"]


async def until_done(runner: BatchRunner, batch_id: str) -> dict[str, Any]:
    for _ in range(500):
        batch = runner.get(batch_id)
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            return batch
        await asyncio.sleep(0.01)
    raise AssertionError(runner.get(batch_id))


def custom_ids(runner: BatchRunner, file_id: str | None) -> list[str]:
    if file_id is None:
        return []
    return [json.loads(x)["custom_id"] for x in runner.store.file_bytes(file_id).decode().splitlines()]


def test_status_walk_counts_and_bound(tmp_path: Path) -> None:
    async def main() -> None:
        models = FakeModels(delay=0.01)
        runner = BatchRunner(BatchStore(tmp_path), models, max_concurrency=3)  # type: ignore[arg-type]
        runner.start()
        batch_id = submit(runner, [line(i) for i in range(10)] + [line(99, body=[1])])
        batch = await until_done(runner, batch_id)
        await runner.close()
        assert batch["status"] == "completed"
        assert batch["request_counts"] == {"total": 11, "completed": 10, "failed": 1}
        assert batch["in_progress_at"] and batch["finalizing_at"] and batch["completed_at"]
        assert sorted(custom_ids(runner, batch["output_file_id"])) == sorted(f"c{i}" for i in range(10))
        assert custom_ids(runner, batch["error_file_id"]) == ["c99"]
        assert models.max_in_flight == 3

    asyncio.run(main())


def test_one_line_at_a_time_while_online_requests_run(tmp_path: Path) -> None:
    async def main() -> None:
        models = FakeModels(delay=0.01, num_online=1)
        runner = BatchRunner(BatchStore(tmp_path), models, max_concurrency=4)  # type: ignore[arg-type]
        runner.start()
        await until_done(runner, submit(runner, [line(i) for i in range(6)]))
        await runner.close()
        assert models.max_in_flight == 1

    asyncio.run(main())


def test_resume_skips_written_lines(tmp_path: Path) -> None:
    async def main() -> None:
        store = BatchStore(tmp_path)
        models = FakeModels()
        first = BatchRunner(store, models, max_concurrency=2)  # type: ignore[arg-type]
        batch_id = submit(first, [line(i) for i in range(5)])  # created, never started: a "crash"
        results = store.results(batch_id)
        for i in (0, 3):  # written before the crash
            results.append(result_line(f"c{i}", 200, {"id": "old"}), ok=True)
        runner = BatchRunner(store, models, max_concurrency=2)  # type: ignore[arg-type]
        runner.start()
        batch = await until_done(runner, batch_id)
        await runner.close()
        assert models.calls == 3
        assert sorted(custom_ids(runner, batch["output_file_id"])) == [f"c{i}" for i in range(5)]
        assert batch["request_counts"]["completed"] == 5

    asyncio.run(main())


def test_expired_lines_go_to_the_error_file(tmp_path: Path) -> None:
    async def main() -> None:
        store = BatchStore(tmp_path)
        runner = BatchRunner(store, FakeModels(), max_concurrency=2)  # type: ignore[arg-type]
        batch_id = submit(runner, [line(i) for i in range(3)])
        record = store.batch(batch_id)
        store.save({**record, "expires_at": int(time.time()) - 1})
        runner.start()
        batch = await until_done(runner, batch_id)
        await runner.close()
        assert batch["status"] == "expired" and batch["expired_at"] and batch["output_file_id"] is None
        errors = [json.loads(x) for x in store.file_bytes(batch["error_file_id"]).decode().splitlines()]
        assert [e["error"]["code"] for e in errors] == ["batch_expired"] * 3

    asyncio.run(main())


def test_cancel_a_queued_batch_at_once(tmp_path: Path) -> None:
    runner = BatchRunner(BatchStore(tmp_path), FakeModels(), max_concurrency=2)  # type: ignore[arg-type]
    batch_id = submit(runner, [line(0)])
    batch = runner.cancel(batch_id)
    assert batch["status"] == "cancelled" and batch["cancelling_at"] and batch["cancelled_at"]
    assert runner.cancel(batch_id)["status"] == "cancelled"  # again: the same answer
