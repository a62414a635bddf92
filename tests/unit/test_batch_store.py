"""The batch store's durability rules and the batch file's validation, without a model."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from llmserve.server.batches.lines import parse_lines, result_line
from llmserve.server.batches.routes import parse_form
from llmserve.server.batches.store import BatchStore, ResultFiles, write_json
from llmserve.server.errors import APIError

CHAT = "/v1/chat/completions"


def test_a_torn_last_line_is_cut_and_runs_again(tmp_path: Path) -> None:
    results = ResultFiles(tmp_path / "b")
    results.append(result_line("a", 200, {"id": "x"}), ok=True)
    results.append(result_line("b", 400, {"error": {}}), ok=False)
    with open(results.output, "a") as f:  # a crash in the middle of appending line "c"
        f.write('{"id": "batch_req_1", "custom_id": "c", "resp')
    done, num_ok, num_failed = results.done_ids()
    assert done == {"a", "b"} and (num_ok, num_failed) == (1, 1)
    assert results.output.read_text().endswith("}\n")  # cut back to the last whole line
    results.append(result_line("c", 200, {"id": "y"}), ok=True)
    assert [json.loads(x)["custom_id"] for x in results.output.read_text().splitlines()] == ["a", "c"]


def test_write_json_replaces_whole_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "x" / "batch.json"
    write_json(path, {"status": "validating"})
    write_json(path, {"status": "in_progress"})
    assert json.loads(path.read_text()) == {"status": "in_progress"}
    assert [p.name for p in path.parent.iterdir()] == ["batch.json"]


def test_files_and_unknown_ids(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    f = store.add_file("in.jsonl", "batch", b"{}\n")
    assert store.file_bytes(f["id"]) == b"{}\n" and [x["id"] for x in store.files()] == [f["id"]]
    store.delete_file(f["id"])
    for call in (lambda: store.file(f["id"]), lambda: store.batch("batch_x"), lambda: store.file("../x")):
        with pytest.raises(APIError) as e:
            call()
        assert e.value.status == 404


@pytest.mark.parametrize(
    ("line", "code"),
    [
        ("not json", "invalid_json_line"),
        ('{"url": "/v1/chat/completions", "body": {}}', "missing_required_parameter"),
        ('{"custom_id": "a", "url": "/v1/chat/completions", "body": {}}', "duplicate_custom_id"),
        ('{"custom_id": "b", "method": "GET", "url": "/v1/chat/completions"}', "invalid_method"),
        ('{"custom_id": "b", "url": "/v1/completions", "body": {}}', "invalid_url"),
    ],
)
def test_lines_that_cannot_run_fail_validation_with_their_number(line: str, code: str) -> None:
    first = json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": {"messages": []}})
    lines, errors = parse_lines(f"{first}\n\n{line}\n".encode(), [CHAT])
    assert [x.custom_id for x in lines] == ["a"]
    assert [(e["code"], e["line"]) for e in errors] == [(code, 3)]


def test_a_bad_body_is_the_lines_own_error_not_the_batchs() -> None:
    lines, errors = parse_lines(b'{"custom_id": "a", "url": "/v1/chat/completions", "body": 5}\n', [CHAT])
    assert not errors and lines[0].body == 5


def test_parse_form_reads_what_http_clients_send() -> None:
    req = httpx.Request("POST", "http://x/v1/files", files={"file": ("a.jsonl", b'{"a": 1}\r\n{}\n')},
                        data={"purpose": "batch"})  # fmt: skip
    fields = parse_form(req.headers["content-type"], req.read())
    assert fields == {"purpose": (None, b"batch"), "file": ("a.jsonl", b'{"a": 1}\r\n{}\n')}
    with pytest.raises(APIError):
        parse_form("application/json", b"{}")


def test_run_batch_refuses_a_file_that_cannot_run_before_loading_a_model(tmp_path: Path, capsys) -> None:
    from llmserve.cli.main import main

    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "a", "url": "/v1/moderations", "body": {}}\n')
    assert (
        main(["run-batch", "-i", str(src), "-o", str(tmp_path / "out.jsonl"), "--model", "/no/such/model"])
        == 2
    )
    assert "url must be one of" in capsys.readouterr().err
    assert main(["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl")]) == 2


def test_one_server_per_batch_folder(tmp_path: Path) -> None:
    import subprocess
    import sys

    first = BatchStore(tmp_path)
    assert first.try_lock()
    code = f"from pathlib import Path; from llmserve.server.batches.store import BatchStore; print(BatchStore(Path({str(tmp_path)!r})).try_lock())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == "False"  # a second server would run the same lines again
