"""Batch-1 greedy decode of one GGUF file through LLM: prints one JSON line.

    PYTHONPATH=<tree>/src python benchmarks/bench_decode_gguf.py FILE [--tokens 128] [--repeats 3]
                                                                [--cpu-activations auto]

Two code trees are compared by running it alternately with PYTHONPATH pointing at each tree's
`src` (each with its extension built: `python setup.py build_ext --inplace` in the tree), several
pairs, on the same file (e.g. one from benchmarks/bench_cpu_scale.py).

Loads the file with LLM(model=FILE, num_kv_blocks=256), warms up with one 16-token generation, then
generates --tokens greedy tokens (ignore_eos) from a fixed 32-token prompt --repeats times; decode
tok/s = (tokens - 1) / (last token time - first token time) from the request's metrics. Reports the
load report's weight bytes, the median decode tok/s and a hash of the generated ids.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics

import llmserve
from llmserve import LLM, SamplingParams


class _Grab(logging.Handler):
    """Keeps the engine's log lines (the load report is one)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu-activations", default="auto")
    args = ap.parse_args()
    grab = _Grab()
    logging.getLogger("llmserve").addHandler(grab)
    logging.getLogger("llmserve").setLevel(logging.INFO)
    llm = LLM(model=args.file, num_kv_blocks=256, cpu_activations=args.cpu_activations, show_progress=False)
    report = next(line for line in grab.lines if line.startswith("loaded "))
    prompt = [(37 * i + 11) % 40000 + 100 for i in range(32)]
    llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    rates, ids = [], []
    for _ in range(args.repeats):
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        m = out.metrics
        toks = out.outputs[0].token_ids
        rates.append((len(toks) - 1) / (m.last_token_time - m.first_token_time))
        ids.append(list(toks))
    assert all(i == ids[0] for i in ids)
    print(
        json.dumps(
            {
                "src": llmserve.__file__,
                "report": report,
                "decode_tok_s": rates,
                "median": statistics.median(rates),
                "ids_sha": hashlib.sha256(json.dumps(ids[0]).encode()).hexdigest()[:16],
            }
        )
    )


if __name__ == "__main__":
    main()
