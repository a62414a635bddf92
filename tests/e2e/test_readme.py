"""The README's examples, run as written on the embedded model, with the answers they show checked.

Each example is read out of README.md itself (only the server's port is changed), so an example
that stops working, or a default that changes an answer the README shows (`print(...)  # Paris.`,
`llmserve generate ...   # The capital of France is Paris.`), fails here and not for a user.
The quantized model runs on the machine's best kernel set and, where that is AVX-512, again on
the AVX2 set (what Zen 3 and older CPUs run).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmserve.layers.quantization import cpu_kernels
from tests.e2e.conftest import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

README = Path(__file__).resolve().parents[2] / "README.md"
LLMSERVE = Path(sys.executable).parent / "llmserve"
KERNEL_SETS = [
    "best",
    pytest.param(
        "avx2",
        marks=pytest.mark.skipif(
            cpu_kernels.best_kernels() != "avx512_vnni", reason="the best kernel set is AVX2 or none"
        ),
    ),
]


def code_block(lang: str, needle: str) -> str:
    """The README's first fenced `lang` block that contains `needle`."""
    for block in re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.DOTALL):
        if needle in block:
            return block
    raise AssertionError(f"README.md has no {lang} block containing {needle!r}")


def shown_answers(code: str) -> list[str]:
    """What the README says each `print(...)` shows: the comment after it."""
    return re.findall(r"^\s*print\(.*\)\s+#\s*(.+?)\s*$", code, flags=re.MULTILINE)


def run_python(code: str, port: int | None = None) -> str:
    """Run a README block in this process; its stdout. `port`: the test server's, for 8000."""
    if port is not None:
        code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})
    return out.getvalue()


def check_answers(code: str, printed: str) -> None:
    answers = shown_answers(code)
    assert answers, f"the example shows no answer to check:\n{code}"
    for answer in answers:
        assert answer in printed, f"README shows {answer!r}; the example printed:\n{printed}"


def kernel_env(kernels: str) -> dict[str, str]:
    return {} if kernels == "best" else {"LLMSERVE_QUANT_KERNELS": kernels}


@pytest.fixture(params=KERNEL_SETS)
def kernels(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module", params=KERNEL_SETS)
def default_server(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[ServerProcess]:
    """`llmserve serve` with no model and no served name: the README's server."""
    folder = tmp_path_factory.mktemp("readme")
    proc = ServerProcess(
        [],
        "--batch-dir",
        str(folder / "batches"),
        env=kernel_env(request.param),
        log_dir=folder,
        served_name=None,
    ).start()
    yield proc
    proc.stop()


def test_first_example_answers_paris(kernels: str) -> None:
    """`llmserve generate "What is the capital of France?"` prints the answer its comment shows."""
    line = next(
        ln for ln in code_block("sh", "llmserve generate").splitlines() if ln.startswith("llmserve generate")
    )
    command, _, shown = line.partition("#")
    argv = shlex.split(command)
    result = subprocess.run(
        [str(LLMSERVE), *argv[1:]], capture_output=True, text=True, timeout=300,
        env={**os.environ, **kernel_env(kernels)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert shown.strip() and shown.strip() in result.stdout, (shown, result.stdout)


def test_curl_chat_streams_the_answer(default_server: ServerProcess) -> None:
    block = code_block("sh", "curl localhost:8000/v1/chat/completions")
    command = block[block.index("curl ") :].replace("localhost:8000", f"127.0.0.1:{default_server.port}")
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    events = [line.removeprefix("data: ") for line in result.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", result.stdout
    text = "".join(
        choice["delta"].get("content") or "" for e in events[:-1] for choice in json.loads(e)["choices"]
    )
    assert "Paris" in text, text


def test_openai_client_example(default_server: ServerProcess) -> None:
    code = code_block("python", "client.completions.create")
    check_answers(code, run_python(code, default_server.port))


def test_ollama_client_example(default_server: ServerProcess) -> None:
    code = code_block("python", "import ollama")
    check_answers(code, run_python(code, default_server.port))


def test_anthropic_client_example(default_server: ServerProcess) -> None:
    code = code_block("python", "import anthropic")
    check_answers(code, run_python(code, default_server.port))


def test_batches_example(default_server: ServerProcess) -> None:
    code = code_block("python", "client.batches.create")
    check_answers(code, run_python(code, default_server.port))


def test_offline_llm_example(kernels: str) -> None:
    code = code_block("python", "from llmserve import LLM")
    before = cpu_kernels.kernels()
    cpu_kernels.set_kernels("auto" if kernels == "best" else kernels)
    try:
        printed = run_python(code)
    finally:
        cpu_kernels.set_kernels(before)
    check_answers(code, printed)
