"""Where the GPU engine's time goes, offline (no server): wall time per workload beside the GPU's
busy time (the sum of its kernels' times from torch.profiler), the kernels that take it, and the
host's Python (cProfile) for the largest batch.

    python benchmarks/gpu/profile_steps.py MODEL_DIR [--out DIR] [--device cuda] [--dtype bfloat16]
        [--cases prefill decode1 decode64 decode256]

A case whose kernel time is far below its wall time is host-bound (scheduling, sampling, output
handling, launches); one whose kernel time is near it is bound by the kernels listed. Writes
DIR/profile.txt (every table) and DIR/profile.json (the figures); prints a summary.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import pstats
import random
import time
from pathlib import Path

CASES = {  # name: (prompts, prompt tokens, output tokens)
    "prefill2050": (8, 2050, 1),
    "prefill": (8, 2048, 1),
    "decode1": (1, 128, 128),
    "decode64": (64, 128, 128),
    "decode256": (256, 128, 128),
    # a server's steady state at concurrency 256: a new request whenever one finishes, so most
    # steps mix a few prefills into the decodes (the served benchmark's pattern, without HTTP)
    "steady256": (256, 128, 128),
}
STEADY_REQUESTS = 4
"""steady*: requests per slot (1,024 at concurrency 256), each 128 -> 128."""


def _device_us(event) -> float:
    """An averaged profiler event's own time on the device (torch renamed the field from cuda_*)."""
    return getattr(event, "self_device_time_total", 0.0) or getattr(event, "self_cuda_time_total", 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per case (the median is reported)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="one more LLM(...) option, e.g. --engine-arg enforce_eager=true")  # fmt: skip
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from llmserve import LLM, SamplingParams

    options = dict(kv.split("=", 1) for kv in args.engine_arg)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=256,
              max_num_batched_tokens=8192, show_progress=False, **options)  # fmt: skip
    vocab = llm.engine.tokenizer.vocab_size
    rng = random.Random(0)
    ids = itertools.count()
    cuda = args.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    args.out.mkdir(parents=True, exist_ok=True)
    report, figures = io.StringIO(), {}

    steps = {"mixed": 0, "all": 0}

    def prompt(length: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(length)]

    def steady(n: int, length: int, out: int) -> None:
        """`n` requests in flight until n * STEADY_REQUESTS have run; counts mixed steps."""
        engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
        total = n * STEADY_REQUESTS
        submitted = done = 0
        while done < total:
            while submitted - done < n and submitted < total:
                engine.add_request(f"steady-{next(ids)}", prompt(length), params)
                submitted += 1
            waiting = len(engine.scheduler.waiting)
            done += sum(o.finished for o in engine.step())
            steps["all"] += 1
            steps["mixed"] += waiting > 0

    def run(n: int, length: int, out: int, mode: str = "batch") -> float:
        prompts = [{"prompt_token_ids": prompt(length)} for _ in range(n)]
        params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        if mode == "steady":
            steady(n, length, out)
        else:
            llm.generate(prompts, params, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for name in args.cases:
        n, length, out = CASES[name]
        mode = "steady" if name.startswith("steady") else "batch"
        pr = cProfile.Profile()  # the first run: compilation, first-use allocations
        pr.enable()
        first = run(n, length, out, mode)
        pr.disable()
        stream = io.StringIO()
        pstats.Stats(pr, stream=stream).sort_stats("cumtime").print_stats(25)
        steps.update(mixed=0, all=0)
        walls = sorted(run(n, length, out, mode) for _ in range(args.repeats))
        wall = walls[len(walls) // 2]
        tokens = n * length if out == 1 else n * out
        if mode == "steady":
            tokens *= STEADY_REQUESTS
            mixed, every = steps["mixed"] / args.repeats, steps["all"] / args.repeats
            print(f"  {name}: {mixed:.0f} of {every:.0f} steps admitted new requests")
        with profile(activities=activities) as prof:
            profiled_wall = run(n, length, out, mode)
        events = prof.key_averages()
        kernel_us = sum(_device_us(e) for e in events)
        figures[name] = {
            "prompts": n, "prompt_tokens": length, "output_tokens": out, "first_wall_s": first, "median_wall_s": wall,
            "tok_s": tokens / wall, "profiled_wall_s": profiled_wall, "gpu_busy_s": kernel_us / 1e6,
        }  # fmt: skip
        line = (
            f"{name}: {n} x {length} -> {out}: first run {first * 1e3:.1f} ms, "
            f"median wall {wall * 1e3:.1f} ms ({tokens / wall:,.0f} tok/s); "
            f"profiled {profiled_wall * 1e3:.1f} ms, GPU busy {kernel_us / 1e3:.1f} ms "
            f"({kernel_us / 1e6 / profiled_wall:.0%})"
        )
        print(line, flush=True)
        report.write(f"\n===== {line}\n")
        report.write(f"----- cProfile of the first run\n{stream.getvalue()}")
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        report.write(events.table(sort_by=sort, row_limit=22, max_name_column_width=70))
        report.write(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))
        if n >= 64:
            pr = cProfile.Profile()
            pr.enable()
            run(n, length, 32, mode)
            pr.disable()
            stream = io.StringIO()
            pstats.Stats(pr, stream=stream).sort_stats("tottime").print_stats(30)
            report.write(f"\n----- cProfile, {name} with 32 output tokens\n{stream.getvalue()}")
    (args.out / "profile.txt").write_text(report.getvalue())
    (args.out / "profile.json").write_text(json.dumps(figures, indent=1))
    print(f"wrote {args.out / 'profile.txt'}")


if __name__ == "__main__":
    main()
