"""A burst of prompts arriving at once, through the engine: each request's TTFT per step budget.

    OMP_NUM_THREADS=1 PYTHONPATH=<tree>/src python benchmarks/bench_burst_ttft.py [FILE] \\
        [--budgets 1024 256] [--prompts 16] [--input-len 128] [--output-len 8] [--threads 1]

bench_cpu_scale.py's c=16 level starts with 16 prompts at once, and its median TTFT is decided by
how the scheduler's token budget (`--max-num-batched-tokens`) cuts that burst into steps: every
prompt prefilled in a step gets its first token when the step ends. This loads FILE (default: the
embedded SmolLM2-135M) once per budget (`LLM`, `--max-num-seqs` = the number of prompts), runs one
unmeasured request, then adds the prompts together and steps the engine until all finish, timing
each step; a request's TTFT is the time of the steps up to the one that gave its first token. On
one thread the time is the main thread's CPU time, which a shared, time-sliced core does not
inflate (the kernels run on the calling thread); with more, wall time.
Prints one JSON line per budget: TTFT median / p90 / max, the gaps between a request's tokens
(ITL: a running request waits for each step's prefill chunks), total, steps, the time per token of
the steps of 64 tokens or more (what a smaller budget must not raise), and a hash of the greedy
outputs, which must be the same for every budget (a token's result does not depend on the batch).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
import time
from collections.abc import Callable

import torch

from llmserve import LLM, SamplingParams


def run_burst(
    file: str, budget: int, args: argparse.Namespace, clock: Callable[[], float]
) -> dict[str, object]:
    llm = LLM(
        model=file,
        max_num_seqs=args.prompts,
        max_num_batched_tokens=budget,
        num_kv_blocks=args.prompts * (-(-(args.input_len + args.output_len) // 16)) + 1,
        show_progress=False,
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    # one unmeasured request first: the first steps of a process pay one-time costs (kernel set-up)
    llm.generate([list(range(100, 100 + args.input_len))], params, use_tqdm=False)
    for j in range(args.prompts):  # distinct prompts: no prefix is shared
        engine.add_request(
            f"burst-{j}", [(37 * i + 11 * j) % 30000 + 100 for i in range(args.input_len)], params
        )
    elapsed, steps = 0.0, 0
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    itl: list[float] = []  # gaps between a request's consecutive tokens
    tokens: dict[str, list[int]] = {}
    big_steps = [0.0, 0]  # time and tokens of the steps of 64 tokens or more (the prefill's)
    while engine.has_unfinished_requests():
        t = clock()
        outputs = engine.step()
        dt = clock() - t
        elapsed += dt
        steps += 1
        if (num_tokens := engine.last_stats.step_tokens) >= 64:
            big_steps[0] += dt
            big_steps[1] += num_tokens
        for out in outputs:
            rid = out.request_id
            if out.outputs[0].token_ids:
                if rid in last:
                    itl.append(elapsed - last[rid])
                first.setdefault(rid, elapsed)
                last[rid] = elapsed
            if out.finished:
                tokens[rid] = list(out.outputs[0].token_ids)
    ttft = sorted(first.values())
    ids = [tokens[f"burst-{j}"] for j in range(args.prompts)]
    del llm, engine
    gc.collect()
    return {
        "budget": budget,
        "ttft_s": {
            "median": round(statistics.median(ttft), 3),
            "p90": round(ttft[int(0.9 * (len(ttft) - 1))], 3),
            "max": round(ttft[-1], 3),
            "all": [round(x, 3) for x in ttft],
        },
        "itl_s": {"median": round(statistics.median(itl), 3), "max": round(max(itl), 3)},
        "total_s": round(elapsed, 3),
        "ms_per_token": round(1000 * big_steps[0] / max(big_steps[1], 1), 3),
        "steps": steps,
        "ids_sha": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", nargs="?", default=None, help="a model (default: the embedded one)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[1024, 256])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    for budget in args.budgets:
        print(json.dumps(run_burst(args.file, budget, args, clock)), flush=True)


if __name__ == "__main__":
    main()
