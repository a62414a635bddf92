"""One sampling step, the code before the GPU-sampler change next to today's: same logits, same
requests, interleaved, median of --repeats. Runs on CUDA when present, else on the CPU.

    python benchmarks/bench_sampler.py [--batch 1 16 64 256] [--vocab 49152 151936]
        [--cases greedy temperature top_k top_p mixed seeded] [--repeats 5] [--baseline REF]

A timed step is what `ModelRunner._sample` does: `SamplingMetadata.build` from the requests'
states, the `Sampler` forward, and the read-back of the sampled ids to the host. "old" is
`src/llmserve/sample/` as of git commit --baseline (read with `git show` into a temporary package;
the default is the commit before the change); "new" is the working tree.

Cases, per request (B of them, vocabulary V, random logits of N(0, 3^2)):
    greedy       temperature 0: the argmax fast path (unchanged; the floor)
    temperature  temperature 0.8, no filter
    top_k        temperature 0.8, top_k 50                 old: a stable sort of every row
    top_p        temperature 0.8, top_p 0.9 (no top-k)      both sort: the set can be any size
    mixed        a cycle of greedy | top_k 50 + top_p 0.9 | min_p 0.05 | top_p 0.95 alone |
                 top_k 40 + repetition and frequency penalties, 8 output tokens each
    seeded       temperature 0.8, top_k 50, a seed per request. "new" uses the device's default
                 mode (the CPU: each request's torch.Generator, as before); "new counter" the
                 Philox mode CUDA defaults to (on the CPU its torch ops, not the Triton kernel)
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from llmserve.sample import RequestSamplingState, make_generator
from llmserve.sample.metadata import SamplingDevicePolicy
from llmserve.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
BASELINE = "65a0a8c"
"""The last commit before the change (sort-based filters, one generator call per seeded row)."""
CASES = ("greedy", "temperature", "top_k", "top_p", "mixed", "seeded")
MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    SamplingParams(temperature=0.8, min_p=0.05),
    SamplingParams(temperature=0.8, top_p=0.95),
    SamplingParams(temperature=0.8, top_k=40, repetition_penalty=1.1, frequency_penalty=0.3),
]


def load_baseline(ref: str) -> ModuleType:
    """`llmserve.sample` as of git `ref`, importable as `llmserve_baseline_sample`."""
    folder = Path(tempfile.mkdtemp(prefix="bench-sampler-")) / "llmserve_baseline_sample"
    folder.mkdir()
    names = subprocess.run(
        ["git", "-C", str(REPO), "ls-tree", "--name-only", ref, "src/llmserve/sample/"],
        check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    for name in names:
        text = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{ref}:{name}"], check=True, capture_output=True, text=True
        ).stdout
        (folder / Path(name).name).write_text(text.replace("llmserve.sample", "llmserve_baseline_sample"))
    sys.path.insert(0, str(folder.parent))
    return importlib.import_module("llmserve_baseline_sample")


def requests(case: str, batch: int, device: torch.device) -> list[RequestSamplingState]:
    def params(i: int) -> SamplingParams:
        return {
            "greedy": SamplingParams(temperature=0.0),
            "temperature": SamplingParams(temperature=0.8),
            "top_k": SamplingParams(temperature=0.8, top_k=50),
            "top_p": SamplingParams(temperature=0.8, top_p=0.9),
            "mixed": MIXED[i % len(MIXED)],
            "seeded": SamplingParams(temperature=0.8, top_k=50, seed=1000 + i),
        }[case]

    return [
        RequestSamplingState(p, [1, 2, 3], [4 + i % 50] * 8, frozenset([0]), make_generator(p.seed, device))
        for i, p in ((i, params(i)) for i in range(batch))
    ]


def step_fn(sample: ModuleType, policy: SamplingDevicePolicy | None, to_host: bool) -> Callable:
    sampler = sample.Sampler()

    def step(logits: torch.Tensor, states: list[RequestSamplingState]) -> None:
        device, vocab_size = logits.device, logits.shape[1]
        if policy is None:
            metadata = sample.SamplingMetadata.build(states, vocab_size, device)
        else:
            metadata = sample.SamplingMetadata.build(states, vocab_size, device, policy=policy)
        out = sampler(logits, metadata)
        out.to_host() if to_host else out.sampled_token_ids.tolist()

    return step


def time_ms(fn: Callable, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", default=BASELINE, help="git ref of the old sampler")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = (
        torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    )
    print(f"# {name}; baseline {args.baseline}; median of {args.repeats} (ms per step)")
    old = load_baseline(args.baseline)
    new = sys.modules["llmserve.sample"]
    variants = {"old": step_fn(old, None, False), "new": step_fn(new, None, True)}
    print(f"{'case':<12} {'B':>4} {'V':>7} {'old':>9} {'new':>9} {'speedup':>8}   {'new counter':>11}")
    for vocab_size in args.vocab:
        for batch in args.batch:
            logits = 3.0 * torch.randn(batch, vocab_size, generator=torch.Generator().manual_seed(0)).to(
                device
            )
            for case in args.cases:
                run = dict(variants)
                if case == "seeded":
                    counter = SamplingDevicePolicy("counter", device.type == "cpu", device.type == "cuda")
                    run["counter"] = step_fn(new, counter, True)
                states = requests(case, batch, device)
                times: dict[str, list[float]] = {k: [] for k in run}
                for fn in run.values():  # warm-up
                    fn(logits, states)
                for _ in range(args.repeats):
                    for key, fn in run.items():
                        times[key].append(time_ms(fn, logits, states))
                med = {k: statistics.median(v) for k, v in times.items()}
                counter_ms = f"{med['counter']:11.2f}" if "counter" in med else ""
                print(
                    f"{case:<12} {batch:>4} {vocab_size:>7} {med['old']:9.2f} {med['new']:9.2f} "
                    f"{med['old'] / med['new']:7.1f}x   {counter_ms}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
