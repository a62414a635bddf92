"""benchmarks/bench_step_gguf.py --bytes-only: the weight bytes a decode step streams, against the file's.

A tiny Llama with three kinds of block: Q4_0 blocks (ffn_down) keep their 18 bytes as symmetric q4;
Q4_K super-blocks (the other matrices) become q4k, their d, dmin and 6-bit sub-scales kept (a byte
each: 148 bytes against the file's 144 per 256); the tied Q5_0 table becomes q8 (34 bytes against
22): the ways a step reads more than the file holds. (The gguf package cannot write Q6_K, the
real files' widened type.) The expected bytes are computed here from the block sizes, the file's
from the gguf package's table of type sizes, not from the script's code.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from tests.gguf_writer import tiny_llama_gguf

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def test_step_bytes_against_the_file(tmp_path: Path) -> None:
    types = {**dict.fromkeys(MATRICES, Q.Q4_K), "ffn_down": Q.Q4_0, "token_embd": Q.Q5_0}
    path = tiny_llama_gguf(tmp_path, types)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_step_gguf.py"), str(path), "--bytes-only"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])["bytes"]

    # the tiny model (tests/gguf_writer.py): hidden 256, 2 layers, 4 heads of 64, 2 KV heads, MLP 512, vocab 512
    H, L, inter, V, kv = 256, 2, 512, 512, 128
    k_shapes = [(H + 2 * kv, H), (H, H), (2 * inter, H)]  # qkv, o, gate_up (Q4_K): [out, in]
    down = (H, inter)  # Q4_0
    # q4k: 128 bytes of nibbles, the half d and dmin, 8 x (sc, mn) per 256; q4: 16 bytes and the half d per 32
    q4k = L * sum(n * (k // 256) * (128 + 4 + 16) for n, k in k_shapes)
    q4 = L * down[0] * (down[1] // 32) * 18
    q8 = V * (H // 32) * 34  # the tied LM head: 32 int8 + the half d
    norms = (2 * L + 1) * H * 4
    assert got["by_format"] == {"q4k": q4k, "q4": q4, "q8": q8, "float": norms}
    assert got["step_bytes"] == q4k + q4 + q8 + norms

    def file_bytes(qtype: Q, n: int, k: int) -> int:
        block, size = GGML_QUANT_SIZES[qtype]
        return n * k // block * size

    matrices = L * (sum(file_bytes(Q.Q4_K, n, k) for n, k in k_shapes) + file_bytes(Q.Q4_0, *down))
    # the test writer also keeps the tied head's float32 copy (output.weight), which the tied
    # LM head never reads: it counts in the file, not in the step
    assert got["file_tensor_bytes"] == matrices + file_bytes(Q.Q5_0, V, H) + norms + V * H * 4
    assert got["ratio"] == round(got["step_bytes"] / got["file_tensor_bytes"], 3)
    assert got["step_bytes"] > got["file_tensor_bytes"] - V * H * 4  # more than it reads of the file


def _busy_loops() -> list[int]:
    """The pids of --busy's spinning processes (their command line holds BUSY_LOOP's code)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and b"busy = float(sys.argv[1])" in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_steps_of_two_builds_beside_a_busy_core(tmp_path: Path) -> None:
    """--builds (two copies of the extension, one runner each), --bare-matmuls and --busy run
    every batch; the two builds' steps are the same bits, and the busy process is gone after."""
    from llmserve import _cpu_kernels

    types = {**dict.fromkeys(MATRICES, Q.Q4_K), "ffn_down": Q.Q4_0, "token_embd": Q.Q5_0}
    path = tiny_llama_gguf(tmp_path, types)
    builds = []
    for name in ("a", "b"):
        build = tmp_path / f"{name}.so"
        build.write_bytes(Path(_cpu_kernels.__file__).read_bytes())
        builds.append(str(build))
    script = str(ROOT / "benchmarks" / "bench_step_gguf.py")
    before = set(_busy_loops())
    cmd = [
        sys.executable,
        script,
        str(path),
        "--threads",
        "2",
        "--repeats",
        "2",
        "--bare-matmuls",
        "--busy",
        "0.25",
    ]
    proc = subprocess.run([*cmd, "--builds", *builds], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    batches = ("decode_1", "decode_4", "decode_16", "prefill_128")
    assert got["busy"] == 0.25
    for label in (*builds, "bare_matmuls"):
        assert set(got[label]) == set(batches)
        assert all(0 <= got[label][b]["min_ms"] <= got[label][b]["median_ms"] for b in batches)  # ms, to 0.1
    assert all(got[f"{b}_same_bits"] is True for b in batches)
    assert set(_busy_loops()) <= before  # killed with the run

    bad = subprocess.run([*cmd[:3], "--busy", "1.5"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode == 2 and "--busy is a fraction of a core in [0, 1), not 1.5" in bad.stderr
