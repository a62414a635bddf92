"""Tensor parallelism on the CPU: decode step time at TP=1 and TP=2 (over the shared-memory
group and over gloo) and what the per-step broadcast of the inputs costs, on a random Llama of
SmolLM2-135M's shape (hidden 576, 30 layers, intermediate 1536, vocabulary 49152, tied), with
8 heads / 4 KV heads of 72 instead of SmolLM2's 9 / 3 of 64, which TP=2 cannot split.

    python benchmarks/bench_tp.py [--batch 1 16] [--steps 32] [--threads N] [--quantization none int4]
    python benchmarks/bench_tp.py --transport    # the group's collectives alone, two processes

`--quantization`: `none` keeps float32 weights (each rank runs the model's layers), `int4` /
`int8` quantize at load (the embedded SmolLM2's Q4_1 math for int4): those run the fused C++
decoder, at TP=2 one shard per rank summing over the shared-memory group (over gloo the layers
run). TP=1 runs with N threads (default: all CPUs), TP=2 with N/2 threads per rank, each
configuration in a process of its own. The broadcast cost is the driver's time in
`TPExecutor.send` per step: the pickled flat batch ("forward") and the hidden rows for the
LM head ("logits"), the only inputs that cross to the workers. CPU ms/step: the user + system
time of every rank's process over the measured steps, per step (a waiting rank's spinning
included); on a machine that other work shares, a steadier figure than the wall time, which
favours TP=2's two processes there (the scheduler gives each process its share).
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.models.tiny
import transformers

from llmserve.distributed import shm
from llmserve.distributed.group import TPGroup
from llmserve.engine.llm import build_engine
from llmserve.layers import numba_jit
from llmserve.model_executor.forward_runner import SequenceBatchEntry
from llmserve.sampling_params import SamplingParams


def _model(folder: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
        num_key_value_heads=4, head_dim=72, max_position_embeddings=2048, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    from tests.models.tiny import save_tiny_tokenizer  # any tokenizer: the prompts are token ids

    save_tiny_tokenizer(folder, 512)


def _run(
    folder: Path, tp: int, threads: int, batch: int, steps: int, quantization: str
) -> tuple[float, float, float]:
    """(median decode step ms, mean broadcast ms per step, CPU ms per step of all the ranks)."""
    options = dict(tensor_parallel_size=tp, threads_per_rank=threads // tp) if tp > 1 else {}
    if tp == 1:  # numba's pool too, as each TP rank's (else its set_num_threads resets torch's to all CPUs)
        torch.set_num_threads(threads)
        numba_jit.limit_threads(threads)
    engine = build_engine(str(folder), show_progress=False, quantization=quantization, **options)
    sent = [0.0]
    if engine.executor is not None:
        send = engine.executor.send

        def timed(command: tuple) -> None:
            t = time.perf_counter()
            send(command)
            sent[0] += time.perf_counter() - t

        engine.executor.send = timed  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [(7 * i + j) % 500 + 1 for j in range(16)], params)
    engine.step()  # the prefill
    ranks = [psutil.Process()] + [
        psutil.Process(w.pid) for w in (engine.executor.workers.processes if engine.executor else [])
    ]
    cpu0 = sum(sum(p.cpu_times()[:2]) for p in ranks)
    sent[0], times = 0.0, []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    cpu = sum(sum(p.cpu_times()[:2]) for p in ranks) - cpu0
    engine.close()
    return statistics.median(times) * 1e3, sent[0] / steps * 1e3, cpu / steps * 1e3


def _transport_worker(port: int, iters: int, shm_path: str | None) -> None:
    torch.set_num_threads(1)
    group = TPGroup.connect(port, 1, 2, shm_path)
    for n in [1, 8, 64]:
        hidden = torch.ones(n, 576)
        for _ in range(iters // 3):
            group.broadcast_object()
            group.all_reduce(hidden)


def transport(batches: list[int], iters: int = 300) -> None:
    """The median cost of broadcasting a decode step's batch of B sequences (each with a
    20-block table) and of one all-reduce of B hidden rows, between two processes of one thread,
    over the transport `LLMSERVE_TP_TRANSPORT` picks (shm unless it says gloo)."""
    torch.set_num_threads(1)
    store = TPGroup.create_store(2)
    shm_path = shm.create_segment(2) if shm.transport() == "shm" else None
    worker = mp.get_context("spawn").Process(
        target=_transport_worker, args=(store.port, iters * len(batches), shm_path), daemon=True
    )
    worker.start()
    group = TPGroup(store, 0, 2, shm_path=shm_path)
    print(f"transport {shm.transport()}")
    print("batch  bytes  broadcast us  all-reduce us")
    for n in batches:
        command = (
            "forward",
            [SequenceBatchEntry([123], 300 + i, list(range(20)), f"req-{i}") for i in range(n)],
        )
        sends, reduces = [], []
        hidden = torch.ones(n, 576)
        for _ in range(iters):
            t0 = time.perf_counter()
            group.broadcast_object(command)
            t1 = time.perf_counter()
            group.all_reduce(hidden)
            sends.append(t1 - t0)
            reduces.append(time.perf_counter() - t1)
        size = len(pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL))
        print(
            f"{n:5d}  {size:5d}  {statistics.median(sends) * 1e6:12.0f}  {statistics.median(reduces) * 1e6:13.0f}"
        )
    worker.join()
    group.close()  # (unlinks the segment)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--quantization", nargs="+", default=["none", "int4"], help="none, int8, int4")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--transport", action="store_true", help="only the collectives' cost (batches 1, 8, 64)")
    ap.add_argument(
        "--one", nargs=4, type=str, metavar=("FOLDER", "TP", "BATCH", "QUANT"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    if args.transport:
        transport([1, 8, 64])
        return
    if args.one:  # one configuration in a fresh process: numba's thread pool is sized per process
        folder, tp, batch, quant = args.one
        print(*_run(Path(folder), int(tp), args.threads, int(batch), args.steps, quant))
        return
    # (TP, transport): TP=1 first, its baseline beside the two TP=2 transports
    configs = [(1, "-"), (2, "shm"), (2, "gloo")]
    with tempfile.TemporaryDirectory() as tmp:
        _model(Path(tmp))
        print("weights  batch  TP  transport  step ms  CPU ms/step  broadcast ms/step  TP=1 / this")
        for quant in args.quantization:
            for batch in args.batch:
                base = None
                for tp, how in configs:
                    cmd = [sys.executable, __file__, "--one", tmp, str(tp), str(batch), quant]
                    cmd += ["--steps", str(args.steps), "--threads", str(args.threads)]
                    env = {**os.environ, shm.ENV: how if tp > 1 else "auto"}
                    out = subprocess.run(
                        cmd, check=True, capture_output=True, text=True, env=env
                    ).stdout.split()
                    step_ms, bcast_ms, cpu_ms = (float(v) for v in out[-3:])
                    base = base or step_ms
                    print(
                        f"{quant:>7}  {batch:5d}  {tp:2d}  {how:>9}  {step_ms:7.2f}  {cpu_ms:11.2f}  "
                        f"{bcast_ms:17.3f}  {base / step_ms:10.2f}x"
                    )


if __name__ == "__main__":
    main()
