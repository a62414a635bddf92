"""Tensor parallelism on the CPU: decode step time at TP=1 and TP=2 and what the per-step
broadcast of the inputs costs, on a random float32 Llama of SmolLM2-135M's shape (hidden 576,
30 layers, intermediate 1536, vocabulary 49152, tied), with 8 heads / 4 KV heads of 72 instead of
SmolLM2's 9 / 3 of 64, which TP=2 cannot split.

    python benchmarks/bench_tp.py [--batch 1 8] [--steps 32] [--threads N]

TP=1 runs with N threads (default: all CPUs), TP=2 with N/2 threads per rank. The broadcast cost
is the driver's time in `MultiprocExecutor.send` per step: the pickled flat batch ("forward") and
the hidden rows for the LM head ("logits"), the only inputs that cross to the workers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from llmserve.engine.llm import build_engine
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


def _run(folder: Path, tp: int, threads: int, batch: int, steps: int) -> tuple[float, float]:
    """(median decode step ms, mean broadcast ms per step)."""
    options = dict(tensor_parallel_size=tp, threads_per_rank=threads // tp) if tp > 1 else {}
    if tp == 1:
        torch.set_num_threads(threads)
    engine = build_engine(str(folder), show_progress=False, **options)
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
    sent[0], times = 0.0, []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    engine.close()
    return statistics.median(times) * 1e3, sent[0] / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        _model(folder)
        print("batch  TP  step ms  broadcast ms/step")
        for batch in args.batch:
            for tp in (1, 2):
                step_ms, bcast_ms = _run(folder, tp, args.threads, batch, args.steps)
                print(f"{batch:5d}  {tp:2d}  {step_ms:7.2f}  {bcast_ms:8.3f}")


if __name__ == "__main__":
    main()
