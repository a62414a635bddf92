"""`BatchRunner`: runs the server's batches, one at a time in creation order, beside online traffic.

A batch's states (each transition stamps its `*_at`; the record is written at each one):

    validating -> in_progress -> finalizing -> completed
         |             |-> cancelling -> (finalizing) -> cancelled      (POST .../cancel)
         |             '-> (finalizing) -> expired                       (past expires_at)
         '-> failed  (an input line that cannot run: not JSON, no custom_id, another url...)

Online requests first, by three means:
1. at most `batch_max_concurrency` lines are in flight (default 2), and only one while online
   requests run and shortly after (`_room`), so the engine's waiting queue never holds more
   than that many batch sequences ahead of an online request under FCFS, and an online
   prefill shares its step with few batch tokens;
2. each line goes in at `BATCH_PRIORITY` (lines.py), behind every online request under
   `--scheduling-policy priority`;
3. result files are appended and fsynced in a worker thread, never on the event loop that
   streams online tokens.
benchmarks/bench_batches.py measures what this costs an online request's TTFT.

Restart: `start()` queues every batch not in a terminal state; `_run` skips the custom_ids already
in its result files (store.py says why that neither loses nor repeats a line).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from pathlib import Path
from typing import Any

from llmserve.server.batches.lines import (
    RETRY_STATUSES,
    BatchLine,
    expired_line,
    parse_lines,
    result_line,
    run_line,
)
from llmserve.server.batches.store import TERMINAL, BatchStore, ResultFiles, new_id, public
from llmserve.server.errors import APIError
from llmserve.server.models import ModelManager

logger = logging.getLogger("llmserve.server")

RECORD_SAVE_INTERVAL = 1.0
"""Seconds between writes of a running batch's record (its counts are rebuilt from the result
files on a restart, so they need not be written per line)."""
RETRY_SECONDS = 0.5
"""Wait before retrying a line that was refused for now (full queue, model loading)."""
COMPLETION_WINDOW_SECONDS = {"24h": 24 * 3600}
ONLINE_HOLD_SECONDS = 2.0
"""How long after the last online request seen the runner keeps to one line in flight."""


class BatchRunner:
    def __init__(self, store: BatchStore, models: ModelManager, max_concurrency: int) -> None:
        self.store = store
        self.models = models
        self.max_concurrency = max_concurrency
        self.current: dict[str, Any] | None = None
        """The record of the batch that runs now (newer than its file on disk)."""
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._saved_at = 0.0
        self._online_seen = -math.inf
        self.owner = False
        """Whether this server holds the batch folder (`start`)."""

    # -- life cycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Queue the batches a previous run left unfinished, then run batches as they come; or,
        when another server holds the folder, serve no batches (`check_owner` answers 503)."""
        try:
            self.owner = self.store.try_lock()
        except OSError as e:  # a read-only home, say: the server still serves everything else
            logger.warning("batches: cannot use %s (%s); the batch routes answer 503", self.store.root, e)
            return
        if not self.owner:
            logger.warning(
                "batches: %s is in use by another server; the batch routes answer 503", self.store.root
            )
            return
        for batch in self.store.batches():
            if batch["status"] not in TERMINAL:
                logger.info("batch %s: resuming (%s)", batch["id"], batch["status"])
                self._queue.put_nowait(batch["id"])
        self._task = asyncio.create_task(self._work())

    async def close(self) -> None:
        """Stop; the lines in flight are aborted and run again after a restart."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # -- the API's operations -----------------------------------------------------------------------

    def check_owner(self) -> None:
        if not self.owner:
            raise APIError(
                503, f"the batch folder {str(self.store.root)!r} is in use by another server or cannot be "
                "written; start this server with its own --batch-dir to serve files and batches",
                code="batch_dir_unavailable",
            )  # fmt: skip

    def create(
        self, input_file_id: str, endpoint: str, window: str, metadata: dict[str, str] | None
    ) -> dict[str, Any]:
        now = int(time.time())
        batch = {
            "id": new_id("batch"), "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file_id, "completion_window": window, "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
            "expires_at": now + COMPLETION_WINDOW_SECONDS[window], "finalizing_at": None,
            "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None,
            "cancelled_at": None, "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata,
        }  # fmt: skip
        self.store.save(batch)
        self._queue.put_nowait(batch["id"])
        return public(batch)

    def get(self, batch_id: str) -> dict[str, Any]:
        if self.current is not None and self.current["id"] == batch_id:
            return public(self.current)
        return public(self.store.batch(batch_id))

    def list(self, after: str | None, limit: int) -> dict[str, Any]:
        """Newest first, as OpenAI lists them; `after`: the last id of the previous page."""
        batches = [self.get(b["id"]) for b in reversed(self.store.batches())]
        ids = [b["id"] for b in batches]
        start = ids.index(after) + 1 if after in ids else 0
        page = batches[start : start + limit]
        return {
            "object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(batches),
        }  # fmt: skip

    def cancel(self, batch_id: str) -> dict[str, Any]:
        running = self.current is not None and self.current["id"] == batch_id
        batch = self.current if running else self.store.batch(batch_id)
        assert batch is not None
        if batch["status"] in ("cancelling", "cancelled"):
            return public(batch)
        if batch["status"] in TERMINAL:
            raise APIError(409, f"batch {batch_id!r} is already {batch['status']}; it cannot be cancelled")
        _stamp(batch, "cancelling")
        if not running:  # queued: nothing runs, finish it now (the worker skips terminal batches)
            self._finish(batch, self.store.results(batch_id), "cancelled")
        self.store.save(batch)
        return public(batch)

    # -- the worker ---------------------------------------------------------------------------------

    async def _work(self) -> None:
        while not self.models.started_up:
            await asyncio.sleep(0.1)
        while True:
            batch_id = await self._queue.get()
            batch = self.store.batch(batch_id)
            if batch["status"] in TERMINAL:
                continue
            self.current = batch
            try:
                await self._run(batch)
            except asyncio.CancelledError:
                self.store.save(batch)
                raise
            except Exception as e:  # a bug or a full disk: fail this batch, keep serving the next
                logger.exception("batch %s failed", batch_id)
                batch["errors"] = {"object": "list", "data": [{"code": "server_error", "message": str(e)}]}
                _stamp(batch, "failed")
                self.store.save(batch)
            finally:
                self.current = None

    async def _run(self, batch: dict[str, Any]) -> None:
        # 1. validate the input file (again, after a restart: it is the source of the line list)
        data = self.store.file_bytes(batch["input_file_id"])
        lines, errors = parse_lines(data, [batch["endpoint"]])
        if errors:
            batch["errors"] = {"object": "list", "data": errors}
            _stamp(batch, "failed")
            self.store.save(batch)
            return
        results = self.store.results(batch["id"])
        done, num_ok, num_failed = results.done_ids()
        batch["request_counts"] = {"total": len(lines), "completed": num_ok, "failed": num_failed}
        if batch["status"] == "validating":
            _stamp(batch, "in_progress")
        self.store.save(batch)
        # 2. run the lines not yet written, a bounded number at a time
        todo = [line for line in lines if line.custom_id not in done]
        end = await self._run_lines(batch, results, todo)
        if end == "expired":  # as OpenAI: each line not run goes to the error file
            done = results.done_ids()[0]
            for line in todo:
                if line.custom_id not in done:
                    results.append(expired_line(line.custom_id), ok=False)
                    batch["request_counts"]["failed"] += 1
        # 3. the result files become file objects; the batch ends
        self._finish(batch, results, end)
        self.store.save(batch)
        logger.info("batch %s %s: %s", batch["id"], end, batch["request_counts"])

    async def _run_lines(self, batch: dict[str, Any], results: ResultFiles, todo: list[BatchLine]) -> str:
        """Run `todo`; the batch's end state: completed, cancelled, or expired."""
        pending = iter(todo)
        in_flight: set[asyncio.Task[None]] = set()
        end = "completed"
        try:
            while True:
                if batch["status"] == "cancelling":
                    end = "cancelled"
                    break
                if time.time() > batch["expires_at"]:
                    end = "expired"
                    break
                room = self._room(len(in_flight))
                while len(in_flight) < room and (line := next(pending, None)) is not None:
                    in_flight.add(asyncio.create_task(self._line(batch, results, line)))
                if not in_flight:
                    break
                finished, in_flight = await asyncio.wait(
                    in_flight, timeout=0.5, return_when=asyncio.FIRST_COMPLETED
                )
                for task in finished:
                    task.result()  # a line's own errors are its result; this re-raises only bugs
        finally:
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
        return end

    def _room(self, num_lines: int) -> int:
        """Lines that may be in flight now: `max_concurrency` on an idle server, one while online
        requests run and for `ONLINE_HOLD_SECONDS` after (so the gaps between one client's
        requests do not let a burst of lines in ahead of its next one; one line keeps the batch
        moving). Online requests: the engine's active requests beyond this batch's lines in
        flight (a line of several prompts, or one not yet in the engine, blurs the count; the
        hold covers the latter)."""
        now = time.monotonic()
        if self.models.num_active > num_lines:
            self._online_seen = now
        return 1 if now - self._online_seen < ONLINE_HOLD_SECONDS else self.max_concurrency

    async def _line(self, batch: dict[str, Any], results: ResultFiles, line: BatchLine) -> None:
        while True:
            status, body = await run_line(self.models, line)
            if status not in RETRY_STATUSES:
                break
            if self.models.closed:  # aborted by the shutdown: not done, it runs after the restart
                return
            await asyncio.sleep(RETRY_SECONDS)
        ok = 200 <= status < 300
        # counted first: a cancel that lands during the write below still leaves the line written
        batch["request_counts"]["completed" if ok else "failed"] += 1
        # fsyncs off the event loop: online requests' tokens do not wait for the disk
        await asyncio.to_thread(results.append, result_line(line.custom_id, status, body), ok)
        if time.monotonic() - self._saved_at > RECORD_SAVE_INTERVAL:
            self._saved_at = time.monotonic()
            self.store.save(
                batch
            )  # on the loop: a record written from a thread could land late, over a newer one

    def _finish(self, batch: dict[str, Any], results: ResultFiles, end: str) -> None:
        """finalizing -> `end`: the result files become file objects (purpose batch_output)."""
        _stamp(batch, "finalizing")
        for path, key in ((results.output, "output_file_id"), (results.errors, "error_file_id")):
            if path.exists() and batch[key] is None:
                name = f"{batch['id']}_{Path(path).stem}.jsonl"
                batch[key] = self.store.add_file(name, "batch_output", None, path)["id"]
        _stamp(batch, end)


def _stamp(batch: dict[str, Any], status: str) -> None:
    batch["status"] = status
    batch[f"{status}_at"] = int(time.time())
