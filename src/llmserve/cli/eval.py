"""`llmserve eval perplexity`: perplexity over a text, and the KL divergence of the model's
next-token distributions from a float reference (by default the same file with quantization
'none'), the way llama.cpp's `llama-perplexity --kl-divergence` reports them.

    llmserve eval perplexity                                   # embedded model, its Q4_1 kept, vs float
    llmserve eval perplexity --model m.gguf --quantization int8 --reference m-f32.gguf --json out.json
    llmserve eval perplexity --model DIR --device cuda --dtype bfloat16 --quantization fp8 --reference-dtype bfloat16

Default text: chapters I-II of Alice's Adventures in Wonderland (public domain, ~6k tokens), shipped
with llmserve (llmserve/bench/data).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from importlib import resources
from pathlib import Path

from llmserve.cli.engine_args import add_engine_args

DEFAULT_TEXT = "alice_ch1-2.txt"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="model quality: perplexity and KL divergence from a float reference")
    eval_sub = p.add_subparsers(dest="eval_command", required=True)
    pp = eval_sub.add_parser("perplexity", help="perplexity (and KLD) over a text, llama-perplexity's way")
    add_engine_args(pp)
    pp.add_argument(
        "--text", type=Path, default=None, help="a UTF-8 text file (default: the shipped Alice text)"
    )
    pp.add_argument(
        "--ctx", type=int, default=512, help="tokens per chunk; the second half of each is scored"
    )
    pp.add_argument(
        "--reference",
        default="same",
        help="the model the KL divergence is measured from: 'same' (this model with quantization none, "
        "float32), 'none' (no KLD), or a model path",
    )
    pp.add_argument(
        "--reference-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
        help="the reference model's dtype (default float32; bfloat16 measures fp8 against bf16 on a GPU)",
    )  # fmt: skip
    pp.add_argument("--json", type=Path, default=None, help="write the figures here")
    pp.set_defaults(func=run_perplexity)


def read_text(path: Path | None) -> str:
    """The file's text as its bytes say (no newline translation: llama-perplexity reads bytes)."""
    if path is None:
        return (resources.files("llmserve.bench") / "data" / DEFAULT_TEXT).read_bytes().decode("utf-8")
    return path.read_bytes().decode("utf-8")


def run_perplexity(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from llmserve.bench.quality import evaluate
    from llmserve.config import ModelConfig
    from llmserve.model_executor.model_loader import load_model
    from llmserve.tokenizer import load_tokenizer

    def load(model: str | None, quantization: str, dtype: str) -> object:
        config = ModelConfig(
            model=model, dtype=dtype, device=args.device, cpu_gemm=args.cpu_gemm, quantization=quantization,
            cpu_activations=args.cpu_activations, show_progress=False,
        )  # fmt: skip
        return load_model(config)

    loaded = load(args.model, args.quantization, args.dtype)
    reference = None
    if args.reference == "same":
        reference = load(args.model, "none", args.reference_dtype)
    elif args.reference != "none":
        reference = load(args.reference, "none", args.reference_dtype)
    tokenizer = load_tokenizer(loaded.source)
    ids = tokenizer.encode(read_text(args.text))  # a BOS only where the model's tokenizer adds one
    if warning := repeated_id_warning(ids):
        print(f"warning: {warning}", file=sys.stderr)
    print(f"model: {loaded.summary()}", file=sys.stderr)
    if reference is not None:
        print(f"reference: {reference.summary()}", file=sys.stderr)
    bar = tqdm(total=len(ids) // args.ctx, desc="chunks", unit="chunk", file=sys.stderr)

    def progress(done: int, total: int) -> None:
        bar.update(done - bar.n)

    kv_dtype = loaded.kv_cache_dtype(args.kv_cache_dtype)  # checked there (parse_kv_cache_dtype)
    with bar:
        result = evaluate(loaded, ids, args.ctx, reference, progress, kv_cache_dtype=kv_dtype)
    print(result.summary())
    if args.json is not None:
        report = {
            "model": str(loaded.source.path),
            "quantization": loaded.quantization,
            "kv_cache_dtype": kv_dtype.name,
            "reference": None if reference is None else str(reference.source.path),
            "reference_dtype": None if reference is None else str(reference.dtype).removeprefix("torch."),
            "n_ctx": args.ctx,
            "text_tokens": len(ids),
            **result.to_dict(),
        }
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def repeated_id_warning(ids: list[int], share: float = 0.5) -> str | None:
    """A warning where one id is more than `share` of the text's tokens: a tokenizer that does
    not know the text's words maps them to its unknown token, and the scores say nothing then."""
    if not ids:
        return None
    token, count = Counter(ids).most_common(1)[0]
    if count <= share * len(ids):
        return None
    return (
        f"token id {token} is {count} of the text's {len(ids)} tokens: the tokenizer does not "
        "know the text's words (its unknown token?), so the perplexity and KLD measure little"
    )
