"""Offline throughput of the embedded model: llmserve in-flight, llmserve static, transformers.

    python benchmarks/bench_throughput.py [--num-requests 128] [--hf-requests 32] [--seed 0]

Workload: `--num-requests` requests whose prompt lengths (32-512) and output lengths (32-256)
are drawn from a fixed seed; prompts are random token ids; greedy, EOS ignored, so every engine
produces exactly the requested number of tokens. Reported per engine: output tokens/s.
  - llmserve in-flight: continuous batching with chunked prefill (the default).
  - llmserve in-flight (blas): the same with `cpu_gemm="blas"` (torch's bmm/MKL instead of
    oneDNN), the baseline for the matmul kernel (skip with --skip-blas).
  - llmserve static: the request-level batching that continuous batching replaced (Orca's
    baseline, HF `generate`): fixed batches of `--max-num-seqs`, prompts padded to the batch's
    longest, run until the longest member is done (finished members computed as padding), then
    the next batch.
  - llmserve static-ragged: the same without the prompt padding (ragged prompts batched as they
    are, which is itself part of what continuous batching brought): the value of admitting
    requests every step, alone.
  - transformers: `generate` in batches of `--hf-batch` (left padded, run to the longest output of
    the batch); only the requested tokens count. It runs the first `--hf-requests` requests (the
    figure is a rate, so a subset measures it in reasonable time).
Also: KV-cache waste (allocated slots not holding a token, time-averaged over in-flight steps) and
a shared-prefix workload: requests sharing a ~1,000-token system prompt, time to first token with
and without prefix caching. Writes benchmarks/results/bench_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from llmserve import LLM, SamplingParams


def workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab - 100) for _ in range(rng.randint(32, 512))], rng.randint(32, 256))
        for _ in range(n)
    ]


def run_llmserve(llm: LLM, work: list[tuple[list[int], int]]) -> dict[str, float]:
    engine = llm.engine
    for i, (prompt, n_out) in enumerate(work):
        engine.add_request(f"b{i}", prompt, SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True))
    start = time.perf_counter()
    waste, steps, produced = [], 0, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        produced += sum(len(c.token_ids) for o in outs if o.finished for c in o.outputs)
        waste.append(engine.kv_waste())
    elapsed = time.perf_counter() - start
    assert produced == sum(n for _, n in work), (produced, sum(n for _, n in work))
    return {
        "output_tok_s": produced / elapsed,
        "seconds": elapsed,
        "steps": steps,
        "kv_waste_mean": statistics.fmean(waste),
        "kv_waste_max": max(waste),
        "preemptions": engine.scheduler.num_preemptions,
    }


def load_transformers(gguf: Path):
    """The transformers model of a GGUF file (its weights dequantized to fp32), in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], num_new_tokens: int, pad_id: int) -> None:
    """One greedy transformers `generate` over a left-padded batch, exactly `num_new_tokens` each."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=num_new_tokens, min_new_tokens=num_new_tokens,
        do_sample=False, pad_token_id=pad_id,
    )  # fmt: skip


def run_transformers(model, work: list[tuple[list[int], int]], batch: int, pad_id: int) -> dict[str, float]:
    start, produced = time.perf_counter(), 0
    for b in range(0, len(work), batch):
        group = work[b : b + batch]
        hf_generate(model, [p for p, _ in group], max(n for _, n in group), pad_id)
        produced += sum(n for _, n in group)
    elapsed = time.perf_counter() - start
    return {"output_tok_s": produced / elapsed, "seconds": elapsed, "requests": len(work)}


def shared_prefix_ttft(llm: LLM, n: int, seed: int, vocab: int) -> float:
    """Median time to first token of requests sharing a 1,000-token system prompt, run one at a
    time after one warm-up request (which fills the prefix cache when it is on)."""
    rng = random.Random(seed + 1)
    system = [rng.randrange(100, vocab - 100) for _ in range(1000)]
    engine = llm.engine
    ttfts = []
    for i in range(n + 1):
        prompt = system + [rng.randrange(100, vocab - 100) for _ in range(rng.randint(8, 32))]
        engine.add_request(f"sp{i}", prompt, SamplingParams(temperature=0, max_tokens=1))
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        if i > 0:
            ttfts.append(time.perf_counter() - start)
    return statistics.median(ttfts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--hf-requests", type=int, default=32)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-blas", action="store_true", help="skip the in-flight run on the blas kernel")
    ap.add_argument("--out", default="benchmarks/results/bench_throughput.json")
    args = ap.parse_args()

    common = dict(
        show_progress=False,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    llm = LLM(**common)
    vocab = llm.engine.vocab_size
    work = workload(args.num_requests, args.seed, vocab)
    results: dict[str, dict[str, float]] = {}
    print(
        f"{len(work)} requests, {sum(len(p) for p, _ in work)} prompt tokens, {sum(n for _, n in work)} output tokens"
    )

    results["llmserve_inflight"] = run_llmserve(llm, work)
    print("in-flight", results["llmserve_inflight"])
    if not args.skip_blas and llm.engine.loaded.linear_kernel != "blas":
        blas = LLM(**common, cpu_gemm="blas")
        results["llmserve_inflight_blas"] = run_llmserve(blas, work)
        print("in-flight (blas)", results["llmserve_inflight_blas"])
        del blas
    for mode in ("static", "static-ragged"):
        static = LLM(**common, batching_mode=mode)
        results[f"llmserve_{mode.replace('-', '_')}"] = run_llmserve(static, work)
        print(mode, results[f"llmserve_{mode.replace('-', '_')}"])
        del static

    if not args.skip_transformers:
        hf = load_transformers(llm.engine.loaded.source.gguf_files[0])
        pad = llm.engine.tokenizer.pad_token_id or 0
        results["transformers"] = run_transformers(hf, work[: args.hf_requests], args.hf_batch, pad)
        print("transformers", results["transformers"])
        del hf

    cached = shared_prefix_ttft(llm, 8, args.seed, vocab)
    uncached = shared_prefix_ttft(LLM(**common, enable_prefix_caching=False), 8, args.seed, vocab)
    results["shared_prefix"] = {
        "ttft_cached_s": cached,
        "ttft_uncached_s": uncached,
        "ratio": uncached / cached,
    }
    print("shared prefix", results["shared_prefix"])

    inflight = results["llmserve_inflight"]["output_tok_s"]
    print("\n| engine | output tok/s | ratio (in-flight / engine) |\n| --- | ---: | ---: |")
    for name in (
        "llmserve_inflight",
        "llmserve_inflight_blas",
        "llmserve_static",
        "llmserve_static_ragged",
        "transformers",
    ):
        if name in results:
            r = results[name]["output_tok_s"]
            print(f"| {name} | {r:.1f} | {inflight / r:.2f}x |")
    print(
        f"KV waste (in-flight): mean {results['llmserve_inflight']['kv_waste_mean']:.2%}, "
        f"max {results['llmserve_inflight']['kv_waste_max']:.2%}"
    )
    print(
        f"shared-prefix TTFT: {uncached:.3f} s without cache, {cached:.3f} s with ({uncached / cached:.1f}x lower)"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"args": vars(args), "threads": torch.get_num_threads(), "results": results}, indent=1)
    )


if __name__ == "__main__":
    main()
