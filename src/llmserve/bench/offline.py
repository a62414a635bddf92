"""The in-process benchmarks: the engine without HTTP.

    run_throughput  every request queued at once through `LLM.generate` (like `vllm bench
                    throughput`): requests/s, output tokens/s, total tokens/s
    run_latency     llama-bench's tests on `LLMEngine` directly, timed by the engine's own
                    request metrics (arrival, first token, finished):
                      ppN  one request prefilling N tokens (max_tokens=1): N / TTFT
                      tgN  B requests after a short prompt, N tokens each, decode only:
                           B*(N-1) / (last finish - last first token); at B=1 that is (N-1)/(E2E-TTFT)

Prompts of the latency tests are random token ids, fresh for every run, so no run reuses another's
prefix-cache blocks. Does not know HTTP or plotting.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from llmserve.bench.datasets import BenchRequest

if TYPE_CHECKING:
    from llmserve.engine.llm import LLM
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.outputs import RequestOutput

TG_PROMPT_LEN = 8  # "a short prompt" before a tg test: one block's worth is enough to start decoding


def run_throughput(llm: LLM, requests: Sequence[BenchRequest], progress: bool = True) -> dict[str, Any]:
    """Generate every request at once (greedy, EOS ignored, max_tokens = its output length)."""
    from llmserve.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=progress)
    elapsed = time.perf_counter() - start
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "total_num_tokens": num_in + num_out,
        "requests_per_second": len(outputs) / elapsed,
        "output_tokens_per_second": num_out / elapsed,
        "tokens_per_second": (num_in + num_out) / elapsed,
    }


@dataclass(frozen=True, slots=True)
class LatencyTest:
    kind: Literal["pp", "tg"]
    num_tokens: int
    batch_size: int = 1

    @property
    def name(self) -> str:
        batch = f" @ b{self.batch_size}" if self.batch_size > 1 else ""
        return f"{self.kind}{self.num_tokens}{batch}"


def latency_tests(prompt_lens: Sequence[int], gen_lens: Sequence[int], batch_size: int) -> list[LatencyTest]:
    """pp tests (batch 1, as llama-bench) then tg tests at `batch_size`; validates the sizes."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    if any(n < 1 for n in prompt_lens):
        raise ValueError(f"prompt lengths must be >= 1, got {list(prompt_lens)}")
    if any(n < 2 for n in gen_lens):
        raise ValueError(
            f"generation lengths must be >= 2 (decode speed needs a second token), got {list(gen_lens)}"
        )
    return [LatencyTest("pp", n) for n in prompt_lens] + [LatencyTest("tg", n, batch_size) for n in gen_lens]


class LatencyRunner:
    """Runs `LatencyTest`s on one engine; each run uses fresh random prompts."""

    def __init__(self, engine: LLMEngine, seed: int = 0) -> None:
        self.engine = engine
        self._rng = random.Random(seed)
        tok = engine.tokenizer
        special = tok.eos_token_ids | {i for i in (tok.bos_token_id, tok.pad_token_id) if i is not None}
        vocab_size = min(
            engine.vocab_size, tok.vocab_size
        )  # a model may pad its embedding past the vocabulary
        self._pool = [i for i in range(vocab_size) if i not in special]
        self._ids = itertools.count()

    def _prompt(self, n: int) -> list[int]:
        return [self._rng.choice(self._pool) for _ in range(n)]

    def _run(self, prompts: list[list[int]], max_tokens: int) -> list[RequestOutput]:
        from llmserve.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        ids = [f"bench-latency-{next(self._ids)}" for _ in prompts]
        for request_id, prompt in zip(ids, prompts, strict=True):
            self.engine.add_request(request_id, prompt, params, final_only=True)
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[i] for i in ids]

    def tokens_per_second(self, test: LatencyTest) -> float:
        """One run of `test`, in tokens/s by the engine's timestamps."""
        if test.kind == "pp":
            (out,) = self._run([self._prompt(test.num_tokens)], max_tokens=1)
            m = out.metrics
            assert m is not None and m.first_token_time is not None
            return test.num_tokens / (m.first_token_time - m.arrival_time)
        outs = self._run([self._prompt(TG_PROMPT_LEN) for _ in range(test.batch_size)], test.num_tokens)
        metrics = [o.metrics for o in outs]
        assert all(m is not None and m.first_token_time is not None and m.finished_time for m in metrics)
        decode_start = max(m.first_token_time for m in metrics)  # type: ignore[union-attr, type-var]
        decode_end = max(m.finished_time for m in metrics)  # type: ignore[union-attr, type-var]
        num_decoded = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        return num_decoded / (decode_end - decode_start)


def run_latency(
    engine: LLMEngine, tests: Sequence[LatencyTest], repetitions: int = 3, seed: int = 0, warmup: bool = True
) -> list[dict[str, Any]]:
    """Each test `repetitions` times (after one discarded warm-up run): mean and std of t/s."""
    if repetitions < 1:
        raise ValueError(f"repetitions must be >= 1, got {repetitions}")
    runner = LatencyRunner(engine, seed)
    loaded = engine.loaded
    rows = []
    for test in tests:
        if warmup:
            runner.tokens_per_second(test)
        samples = [runner.tokens_per_second(test) for _ in range(repetitions)]
        rows.append(
            {
                "model": loaded.source.name,
                "device": str(loaded.device),
                "dtype": str(loaded.dtype).removeprefix("torch."),
                "test": test.name,
                "kind": test.kind,
                "num_tokens": test.num_tokens,
                "batch_size": test.batch_size,
                "samples_tps": samples,
                "mean_tps": statistics.fmean(samples),
                "std_tps": statistics.stdev(samples) if len(samples) > 1 else 0.0,
            }
        )
    return rows
