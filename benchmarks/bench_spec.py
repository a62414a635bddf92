"""Speculative decoding (n-gram) against plain decoding, side by side in one process, on the
embedded model: batch-1 decode speed on input-grounded prompts (the answer reuses its input) and
on open-ended ones, and throughput with 16 requests at once.

    python benchmarks/bench_spec.py [--rounds 2] [--max-tokens 256] [--spec '{"method": "ngram", ...}']
                                    [--cpu-activations auto|int16|int8]

Prompts: benchmarks/data/spec_prompts.json: `grounded` (code edits returning the whole file,
corrections, rewrites, summaries, extraction, on 100-300 token inputs), `grounded_short` (the same
kinds of task on 2-6 line inputs) and `open`. Both engines run with the same --cpu-activations, so
their greedy outputs must be equal. Batch 1: each prompt alone, greedy, plain and
speculative interleaved prompt by prompt; decode speed is (tokens - 1) / (last token - first
token) per request, summed per category; the ratio of the sums is the speed-up (and the median of
per-prompt ratios is reported beside it). Greedy outputs are compared token for token. c=16: the
category's prompts repeated to 16, all submitted at once; output tokens / wall time (grounded and
open).
Results: benchmarks/results/spec-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from llmserve import LLM, SamplingParams

HERE = Path(__file__).resolve().parent
DEFAULT_SPEC = (
    '{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 3, "prompt_lookup_max": 5}'
)


def decode_rate(out) -> tuple[int, float]:
    """(decode tokens, decode seconds) of one finished request."""
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    return n - 1, max(1e-9, (m.last_token_time or 0.0) - (m.first_token_time or 0.0))


def step_cost(llm: LLM, context: int = 300, repeats: int = 30) -> dict[int, float]:
    """Median milliseconds of one forward pass (with the LM head) over n new tokens of one
    sequence with `context` tokens cached: what verifying n - 1 proposed tokens costs."""
    import torch

    from llmserve.model_executor.forward_runner import SequenceBatchEntry

    runner = llm.engine.runner.runner
    blocks = list(range((context + 32) // llm.engine.kv_info.block_size + 1))
    out = {}
    with torch.inference_mode():
        runner.forward([SequenceBatchEntry(list(range(100, 100 + context)), context, blocks)])
        for n in (1, 2, 3, 5, 8):
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                hidden = runner.forward(
                    [SequenceBatchEntry(list(range(7, 7 + n)), context + n, blocks)]
                ).hidden
                runner.model.compute_logits(hidden)
                times.append(time.perf_counter() - start)
            out[n] = 1e3 * statistics.median(times)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--cpu-activations", default="auto", choices=["auto", "int16", "int8"])
    p.add_argument("--spec", default=DEFAULT_SPEC)
    p.add_argument("--model", default=None)
    p.add_argument("--skip-c16", action="store_true", help="batch 1 only")
    args = p.parse_args()
    prompts = json.loads((HERE / "data" / "spec_prompts.json").read_text())
    common = {"model": args.model, "kv_cache_memory": 512 * 2**20, "show_progress": False,
              "cpu_activations": args.cpu_activations}  # fmt: skip
    engines = {"plain": LLM(**common), "spec": LLM(**common, speculative_config=args.spec)}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    kernels = engines["plain"].engine.loaded.linear_kernel  # names int8 activations where they run
    report: dict = {"command": " ".join(sys.argv), "spec": json.loads(args.spec), "batch1": {}, "c16": {},
                    "cpu_activations": args.cpu_activations, "kernels": kernels}  # fmt: skip
    print(f"matmuls: {kernels}")
    report["step_ms_by_tokens"] = cost = step_cost(engines["plain"])
    print("one forward pass, ms by new tokens:", ", ".join(f"{n}: {ms:.2f}" for n, ms in cost.items()))

    for category in ("grounded", "grounded_short", "open"):
        sums = {name: [0, 0.0] for name in engines}
        ratios, mismatches = [], 0
        per_prompt: dict[str, list[float]] = {}
        spec_before = engines["spec"].engine.scheduler.spec_stats
        for _ in range(args.rounds):
            for text in prompts[category]:
                messages = [{"role": "user", "content": text}]
                rates, tokens = {}, {}
                for name, llm in engines.items():
                    (out,) = llm.chat(messages, params, use_tqdm=False)
                    n, seconds = decode_rate(out)
                    sums[name][0] += n
                    sums[name][1] += seconds
                    rates[name] = n / seconds
                    tokens[name] = out.outputs[0].token_ids
                ratios.append(rates["spec"] / rates["plain"])
                per_prompt.setdefault(text[:60], []).append(rates["spec"] / rates["plain"])
                mismatches += tokens["spec"] != tokens["plain"]
        stats = engines["spec"].engine.scheduler.spec_stats
        proposed = stats.num_draft_tokens - spec_before.num_draft_tokens
        accepted = stats.num_accepted_tokens - spec_before.num_accepted_tokens
        rate = {name: s[0] / s[1] for name, s in sums.items()}
        report["batch1"][category] = {
            "decode_tok_s": rate,
            "speedup": rate["spec"] / rate["plain"],
            "median_prompt_speedup": statistics.median(ratios),
            "greedy_mismatches": mismatches,
            "acceptance": accepted / proposed if proposed else None,
            "proposed_tokens": proposed,
            "per_prompt_speedup": {t: statistics.median(v) for t, v in per_prompt.items()},
        }
        print(
            f"batch 1, {category}: plain {rate['plain']:.1f} tok/s, spec {rate['spec']:.1f} tok/s -> "
            f"{rate['spec'] / rate['plain']:.2f}x (median per prompt {statistics.median(ratios):.2f}x); "
            f"acceptance {accepted}/{proposed}; greedy mismatches {mismatches}"
        )

    for category in () if args.skip_c16 else ("grounded", "open"):
        batch = [[{"role": "user", "content": t}] for t in (prompts[category] * 16)[:16]]
        result = {}
        for _ in range(args.rounds):
            for name, llm in engines.items():
                start = time.perf_counter()
                outs = llm.chat(batch, params, use_tqdm=False)
                wall = time.perf_counter() - start
                result.setdefault(name, []).append(sum(len(o.outputs[0].token_ids) for o in outs) / wall)
        tput = {name: statistics.median(v) for name, v in result.items()}
        report["c16"][category] = {"tok_s": tput, "ratio": tput["spec"] / tput["plain"]}
        print(f"c=16, {category}: plain {tput['plain']:.1f} tok/s, spec {tput['spec']:.1f} tok/s -> "
              f"{tput['spec'] / tput['plain']:.2f}x")  # fmt: skip

    a, b = engines["spec"].engine.controller.cost()
    report["controller_cost_ms"] = {"a": 1e3 * a, "b": 1e3 * b}
    print(f"the controller's step-cost fit: a = {1e3 * a:.2f} ms, b = {1e3 * b:.2f} ms per token")
    out = HERE / "results" / f"spec-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
