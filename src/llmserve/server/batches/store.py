"""`BatchStore`: the Files and Batches APIs' state on disk, under `--batch-dir`.

    <batch-dir>/files/<file id>.json          a file object (OpenAI's shape) + where its bytes are
    <batch-dir>/files/<file id>.jsonl         an uploaded file's bytes
    <batch-dir>/batches/<batch id>.json       a batch object, with its internal fields (`_*`)
    <batch-dir>/batches/<batch id>/output.jsonl   finished lines that answered 2xx (append-only)
    <batch-dir>/batches/<batch id>/errors.jsonl   finished lines that did not

Durability, the two rules a restart relies on:
1. objects are written whole or not at all: a temp file, fsync, rename (`write_json`);
2. a line is done once its result line is in output.jsonl or errors.jsonl, appended, flushed and
   fsynced (`ResultFiles.append`). A crash mid-append leaves a torn last line, which `done_ids`
   cuts off (that line runs again); a line computed but not yet written runs again too. So a
   restart neither loses nor repeats a line.

The store knows nothing about models or HTTP routes beyond raising `APIError`s for unknown ids.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from llmserve.server.errors import APIError

TERMINAL = frozenset({"completed", "failed", "cancelled", "expired"})


def default_batch_dir() -> Path:
    """`$XDG_CACHE_HOME/llmserve/batches`, else `~/.cache/llmserve/batches`."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "llmserve" / "batches"


def new_id(prefix: str) -> str:
    """`prefix_` + 24 hex digits that sort in creation order (nanoseconds, then 4 random bytes):
    lists ordered by (created_at, id) are then newest-first within a second too."""
    return f"{prefix}_{time.time_ns():016x}{secrets.token_hex(4)}"


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """Write `obj` atomically: a reader (or a restart) sees the old object or the new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Make a rename or a new file's name durable (POSIX: the folder's entry needs its own fsync)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def public(obj: dict[str, Any]) -> dict[str, Any]:
    """An object as the API shows it: the internal `_*` fields left out."""
    return {k: v for k, v in obj.items() if not k.startswith("_")}


class ResultFiles:
    """A batch's two append-only result files (output.jsonl and errors.jsonl)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._lock = threading.Lock()  # appends come from worker threads (runner.py)
        self.output = folder / "output.jsonl"
        self.errors = folder / "errors.jsonl"

    def done_ids(self) -> tuple[set[str], int, int]:
        """The custom_ids already written, and the numbers of output and error lines; a torn last
        line (a crash mid-append) is cut off first, so its request runs again."""
        done: set[str] = set()
        counts = []
        for path in (self.output, self.errors):
            n = 0
            if path.exists():
                _cut_torn_tail(path)
                for line in path.read_text().splitlines():
                    done.add(json.loads(line)["custom_id"])
                    n += 1
            counts.append(n)
        return done, counts[0], counts[1]

    def append(self, line: dict[str, Any], ok: bool) -> None:
        """Append one result line durably: it counts as done once this returns."""
        text = json.dumps(line) + "\n"
        with self._lock:
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.output if ok else self.errors
            new = not path.exists()
            with open(path, "a") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            if new:
                _fsync_dir(self.folder)


def _cut_torn_tail(path: Path) -> None:
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
            f.flush()
            os.fsync(f.fileno())


class BatchStore:
    """Files and batch records under one folder; created lazily on the first write."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files_dir = root / "files"
        self.batches_dir = root / "batches"
        self._lock_file: IO[bytes] | None = None

    def try_lock(self) -> bool:
        """Take the folder for this process (an exclusive `flock`, released when the process ends,
        even by SIGKILL); False when another server holds it: two runners on one folder would run
        the same lines twice."""
        self.root.mkdir(parents=True, exist_ok=True)
        f = open(self.root / ".lock", "wb")  # noqa: SIM115 (held open for the process's life)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            return False
        self._lock_file = f
        return True

    # -- files --------------------------------------------------------------------------------------

    def add_file(
        self, filename: str, purpose: str, data: bytes | None, path: Path | None = None
    ) -> dict[str, Any]:
        """A new file object: `data` stored under files/, or an existing `path` (a batch's results)."""
        file_id = new_id("file")
        if path is None:
            assert data is not None
            path = self.files_dir / f"{file_id}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        obj = {
            "id": file_id, "object": "file", "bytes": path.stat().st_size, "created_at": int(time.time()),
            "filename": filename, "purpose": purpose, "status": "processed", "status_details": None,
            "_path": str(path),
        }  # fmt: skip
        write_json(self.files_dir / f"{file_id}.json", obj)
        return obj

    def file(self, file_id: str) -> dict[str, Any]:
        path = self.files_dir / f"{file_id}.json"
        if "/" in file_id or not path.exists():
            raise APIError(404, f"no file with id {file_id!r}", param="file_id", code="file_not_found")
        return json.loads(path.read_text())

    def file_bytes(self, file_id: str) -> bytes:
        return Path(self.file(file_id)["_path"]).read_bytes()

    def files(self) -> list[dict[str, Any]]:
        return sorted(_read_all(self.files_dir), key=lambda f: (f["created_at"], f["id"]))

    def delete_file(self, file_id: str) -> None:
        obj = self.file(file_id)
        (self.files_dir / f"{file_id}.json").unlink()
        if Path(obj["_path"]).parent == self.files_dir:  # an upload; a batch's results stay with it
            Path(obj["_path"]).unlink(missing_ok=True)

    # -- batches ------------------------------------------------------------------------------------

    def save(self, batch: dict[str, Any]) -> None:
        write_json(self.batches_dir / f"{batch['id']}.json", batch)

    def batch(self, batch_id: str) -> dict[str, Any]:
        path = self.batches_dir / f"{batch_id}.json"
        if "/" in batch_id or not path.exists():
            raise APIError(404, f"no batch with id {batch_id!r}", param="batch_id", code="batch_not_found")
        return json.loads(path.read_text())

    def batches(self) -> list[dict[str, Any]]:
        """Every batch, oldest first."""
        return sorted(_read_all(self.batches_dir), key=lambda b: (b["created_at"], b["id"]))

    def results(self, batch_id: str) -> ResultFiles:
        return ResultFiles(self.batches_dir / batch_id)


def _read_all(folder: Path) -> Iterator[dict[str, Any]]:
    if folder.exists():
        for path in folder.glob("*.json"):
            yield json.loads(path.read_text())
