"""Structured outputs: what a JSON schema costs next to free generation, offline on the embedded model.

  python benchmarks/bench_structured.py [--repeats 3] [--max-tokens 96]

- compile: a fresh manager per schema (llguidance grammar built, validated against the 49k-token
  vocabulary, first matcher and first mask), median over the schema set; the LLTokenizer itself
  is built once per engine and reported apart;
- mask: the time of each per-token mask (`GrammarState.fill_bitmask`) during the runs below;
- time per output token at batch 1 and 16: the same chat prompts, greedy, each request's tokens
  capped at --max-tokens, constrained by a schema (it ends when the JSON closes) and free
  (ignore_eos, so it runs to the cap); TPOT = wall time / output tokens, both runs interleaved,
  median of --repeats. Prompts are short (about 40 tokens), so prefill is a small share of both.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmserve import LLM, SamplingParams, StructuredOutputsParams
from llmserve.structured_output import GrammarState, StructuredOutputManager, bitmask_words
from structured_schemas import SCHEMAS

QUESTIONS = ["Describe Paris.", "Give me a person record.", "Is the sea blue?", "List two people and ages.",
             "Report the result.", "Describe Rome.", "Describe a cat.", "Summarize the weather."]  # fmt: skip


def compile_times(llm: LLM) -> tuple[float, list[float]]:
    engine = llm.engine
    start = time.perf_counter()
    _ = StructuredOutputManager(
        engine.tokenizer, engine.vocab_size, engine.tokenizer.eos_token_ids
    ).ll_tokenizer
    tokenizer_s = time.perf_counter() - start
    shared = engine.structured_outputs
    _ = shared.ll_tokenizer  # built once; each schema below compiles against it
    times = []
    for schema in SCHEMAS:
        shared._cache.clear()
        start = time.perf_counter()
        state = shared.new_state(StructuredOutputsParams(json=schema))
        state.fill_bitmask(torch.zeros(bitmask_words(engine.vocab_size), dtype=torch.int32))
        times.append(time.perf_counter() - start)
    return tokenizer_s, times


def run(llm: LLM, batch: int, constrained: bool, max_tokens: int) -> list[float]:
    """Seconds of each decode step while all `batch` chats are decoding, in order.

    Constrained requests end when their JSON closes and free ones run to the cap, so a whole-run
    average would compare a shrinking batch with a full one; full-batch decode steps compare the
    same work."""
    engine, tok = llm.engine, llm.get_tokenizer()
    for i in range(batch):
        conv = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + " Answer in JSON."}]
        ids = tok.encode(tok.apply_chat_template(conv, add_generation_prompt=True), add_special_tokens=False)
        constraint = StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]) if constrained else None
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=not constrained,
                                structured_outputs=constraint)  # fmt: skip
        engine.add_request(f"bench-{constrained}-{batch}-{i}-{time.monotonic_ns()}", ids, params)
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if (
            engine.last_stats is not None
            and engine.last_stats.step_tokens == batch == engine.last_stats.num_running
        ):
            steps.append(elapsed)
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument(
        "--masks", choices=["auto", "beside", "after"], default="auto",
        help="grammar masks computed beside the forward pass (worker thread) or after it; auto: the engine's choice",
    )  # fmt: skip
    args = ap.parse_args()
    llm = LLM(show_progress=False)
    if args.masks != "auto":
        llm.engine.runner.overlap_masks = args.masks == "beside"
    print(f"masks: {'beside' if llm.engine.runner.overlap_masks else 'after'} the forward pass")
    tokenizer_s, compile_s = compile_times(llm)
    print(
        f"LLTokenizer for the {llm.engine.vocab_size}-token vocabulary: {1e3 * tokenizer_s:.0f} ms (once per engine)"
    )
    print(f"compile + first mask per schema: median {1e3 * statistics.median(compile_s):.2f} ms, "
          f"max {1e3 * max(compile_s):.2f} ms over {len(compile_s)} schemas")  # fmt: skip

    mask_times: list[float] = []
    original = GrammarState.fill_bitmask

    def timed(self: GrammarState, row) -> None:  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        original(self, row)
        mask_times.append(time.perf_counter() - t)

    GrammarState.fill_bitmask = timed  # type: ignore[method-assign]
    run(llm, 2, True, 8)  # warm-up
    for batch in (1, 16):
        free, schema = [], []
        for _ in range(args.repeats):
            # the same step positions of both runs (the same context lengths): the first k
            free_steps, schema_steps = (
                run(llm, batch, False, args.max_tokens),
                run(llm, batch, True, args.max_tokens),
            )
            k = min(len(free_steps), len(schema_steps))
            free.append(statistics.median(free_steps[:k]) / batch)
            schema.append(statistics.median(schema_steps[:k]) / batch)
        f, s = statistics.median(free), statistics.median(schema)
        print(f"batch {batch:2d}: TPOT free {1e3 * f:.2f} ms, JSON schema {1e3 * s:.2f} ms: {s / f:.3f}x")
    print(f"per-token mask: median {1e6 * statistics.median(mask_times):.0f} us, "
          f"p99 {1e6 * sorted(mask_times)[int(0.99 * len(mask_times))]:.0f} us over {len(mask_times)} masks")  # fmt: skip


if __name__ == "__main__":
    main()
