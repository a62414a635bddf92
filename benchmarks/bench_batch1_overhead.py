"""Issue 30's per-token cost at batch 1, from the bare fused step to the served token, in
alternation (the same minutes: this machine's memory bandwidth drifts by up to 30%):

    PYTHONPATH=src python benchmarks/bench_batch1_overhead.py FILE [--rounds 3] [--tokens 128]
        [--prompt-len 128] [--no-serve] [--out DIR]

One process loads FILE as `LLM` with the server's flags in bench_cpu_scale (`--max-num-seqs 16
--max-model-len 272`); unless --no-serve, `llmserve serve FILE` with the same flags runs beside
it (idle while the other two run). Each round measures, one after the other:

  step     the engine's own `ForwardRunner.execute` on one decode token at each context of a
           request (prompt-len .. prompt-len + tokens - 1): the fused decoder and the LM head,
           bench_step_gguf's decode_1 at the matching contexts, with no scheduler or sampler;
  engine   `LLMEngine.step()` over one request (a fresh random prompt of prompt-len tokens,
           `tokens` out, greedy, EOS ignored): the decode steps' wall time, split into the
           scheduler, the forward pass, the LM head, the sampler, `update_from_output` and
           output processing (detokenizing) by timers around each call;
  served   one streamed /v1/completions request of the same shape: the gaps between the SSE
           chunks as the client receives them (what bench serve's TPOT averages).

Each figure is the median over a round's tokens; the JSON (OUT/bench_batch1_overhead.json) keeps
every round, and the summary is the median of the rounds. The step's KV writes land in blocks no
request holds (each round's prompt is fresh, so no cached prefix is read back).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import httpx

from compare import server_process
from cpu_scale.plan import WORKLOAD
from cpu_scale.servers import llmserve_command
from gpu.runs import MODEL_NAME, free_port
from llmserve import LLM, SamplingParams
from llmserve.model_executor.forward_runner import SequenceBatchEntry

VOCAB_RANGE = (1000, 40000)  # token ids a random prompt draws from (inside every vocabulary here)


def fresh_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB_RANGE) for _ in range(n)]


def ms_median(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 3)


def bare_steps(llm: LLM, prompt_len: int, num_tokens: int) -> dict[str, Any]:
    """One decode token at each context prompt_len .. prompt_len + num_tokens - 1 through the
    engine's own runner (fused decoder + LM head), between requests: no request holds the cache's
    last blocks then, and every round's prompt is fresh, so no later request reads what this
    writes there as a cached prefix."""
    runner = llm.engine.runner.runner
    bs = runner.block_size
    blocks = -(-(prompt_len + num_tokens) // bs)
    table = list(range(runner.num_blocks - blocks, runner.num_blocks))
    times = []
    for i in range(num_tokens + 1):
        entry = SequenceBatchEntry([VOCAB_RANGE[0] + i], prompt_len + i, table)
        start = time.perf_counter()
        runner.execute([entry])
        times.append(time.perf_counter() - start)
    return {"per_token_ms": ms_median(times[1:])}  # the first is a warm-up


@contextmanager
def timed(record: dict[str, list[float]], obj: object, names: dict[str, str]) -> Iterator[None]:
    """Time every call of `obj`'s methods `names` (attribute -> label) into `record`."""
    originals = {attr: getattr(obj, attr) for attr in names}
    own = {attr for attr in names if attr in vars(obj)}  # instance attributes (the sampler module)

    def wrap(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                record[label].append(time.perf_counter() - start)

        return timed_call

    for attr, label in names.items():
        setattr(obj, attr, wrap(originals[attr], label))
    try:
        yield
    finally:
        for attr in names:
            if attr in own:
                setattr(obj, attr, originals[attr])
            else:
                delattr(obj, attr)  # the wrapper goes; the class's method shows again


def engine_loop(llm: LLM, prompt: list[int], num_tokens: int, breakdown: bool) -> dict[str, Any]:
    """One request through `LLMEngine.step()`: the decode steps' median wall time, and (with
    `breakdown`) the median of each part of a decode step."""
    engine, mr = llm.engine, llm.engine.runner
    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True, temperature=0.0)
    parts: dict[str, list[float]] = defaultdict(list)
    targets = [
        (engine.scheduler, {"schedule": "schedule", "update_from_output": "update_from_output"}),
        (engine.output_processor, {"process_outputs": "output_processing"}),
        (mr.runner, {"forward": "forward", "compute_logits": "lm_head"}),
        (mr, {"sampler": "sampler"}),
    ]
    steps = []
    with ExitStack() as stack:
        for obj, names in targets if breakdown else ():
            stack.enter_context(timed(parts, obj, names))
        engine.add_request(f"overhead-{random.random()}", prompt, params)
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
    out: dict[str, Any] = {"per_token_ms": ms_median(steps[1:]), "prefill_ms": round(steps[0] * 1e3, 1)}
    if breakdown:  # each part's decode steps (the first call was the prefill's)
        out["parts_ms"] = {label: ms_median(t[1:]) for label, t in parts.items()}
        out["parts_ms"]["rest"] = round(out["per_token_ms"] - sum(out["parts_ms"].values()), 3)
    return out


def served_stream(client: httpx.Client, base_url: str, prompt: list[int], num_tokens: int) -> dict[str, Any]:
    """One streamed completion: the gaps between SSE chunks carrying text, as received."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": num_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True}  # fmt: skip
    arrivals = []
    start = time.perf_counter()
    with client.stream("POST", f"{base_url}/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return {"per_token_ms": ms_median(gaps), "ttft_ms": round((arrivals[0] - start) * 1e3, 1),
            "num_chunks": len(arrivals)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=WORKLOAD.output_len)
    ap.add_argument("--prompt-len", type=int, default=WORKLOAD.input_len)
    ap.add_argument("--no-serve", action="store_true", help="the step and the engine only")
    ap.add_argument("--no-breakdown", action="store_true", help="no timers inside the engine's step")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/batch1_overhead"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    w = WORKLOAD
    llm = LLM(str(args.file), max_num_seqs=w.max_num_seqs, max_model_len=w.slot_len())
    rng = random.Random(0)
    rounds: list[dict[str, Any]] = []
    port = free_port()
    server = (
        nullcontext(None)
        if args.no_serve
        else server_process(llmserve_command(args.file, port, w), port, args.out / "server.log")
    )
    with server as up, httpx.Client() as client:
        base_url = None if up is None else up[0]
        if base_url:  # a warm-up request: the server's first steps compile and fault pages in
            served_stream(client, base_url, fresh_prompt(rng, args.prompt_len), 8)
        engine_loop(llm, fresh_prompt(rng, args.prompt_len), 8, breakdown=False)
        for r in range(args.rounds):
            row: dict[str, Any] = {"step": bare_steps(llm, args.prompt_len, args.tokens)}
            row["engine"] = engine_loop(llm, fresh_prompt(rng, args.prompt_len), args.tokens,
                                        not args.no_breakdown)  # fmt: skip
            if base_url:
                row["served"] = served_stream(
                    client, base_url, fresh_prompt(rng, args.prompt_len), args.tokens
                )
            rounds.append(row)
            print(f"round {r}: " + json.dumps(row), flush=True)
    summary = {name: statistics.median(r[name]["per_token_ms"] for r in rounds) for name in rounds[0]}
    result = {"argv": sys.argv, "file": str(args.file), "rounds": rounds, "median_per_token_ms": summary}
    (args.out / "bench_batch1_overhead.json").write_text(json.dumps(result, indent=1))
    print("median per-token ms over rounds: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
