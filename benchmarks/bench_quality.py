"""Quality of llmserve's quantized paths against llama.cpp's on the same files and the same text:
perplexity and the KL divergence of next-token distributions from the float model.

    python benchmarks/bench_quality.py [--ctx 512] [--out benchmarks/results/bench_quality.json]

Text: the shipped chapters I-II of Alice's Adventures in Wonderland (6062 tokens; llmserve's
tokenizer gives llama.cpp's ids for it). Reference: the embedded model's weights in F32
(benchmarks/peers/gguf_to_f32.py); Q8_0, Q4_0, Q4_1 and BF16 files are made from it by llama.cpp's
own llama-quantize. Both engines score positions 256..510 of each 512-token chunk (11 chunks):
  - llama.cpp: `llama-perplexity --kl-divergence-base` on the F32 file, then `--kl-divergence` on
    each quantized file (and on the F32 file with a q8_0 KV cache, `-ctk q8_0 -ctv q8_0 -fa on`);
  - llmserve: `llmserve.bench.quality.evaluate` (what `llmserve eval perplexity` runs) with the F32
    file at quantization 'none' as the reference, each model with the KV cache the server gives it
    (`auto`: float16 under quantized weights, like llama.cpp's default cache; float32 otherwise);
    activations rounded to int16 per token, and for the Q4_1 and Q4_0 files also to int8 per block
    (`--cpu-activations int8`, llama.cpp's own rounding and the default on AVX-512 VNNI CPUs).
Rows pair each llama.cpp run with llmserve on the same file (or the same bit width quantized by
llmserve itself from the F32 file). Needs the llama.cpp tools built by build_llama_server.sh.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from llmserve.bench.quality import evaluate
from llmserve.config import ModelConfig
from llmserve.model_executor.model_loader import load_model
from llmserve.model_executor.model_loader.source import DEFAULT_MODEL, resolve_model
from llmserve.tokenizer import load_tokenizer
from peers.gguf_to_f32 import ensure_f32_gguf, ensure_quantized_gguf, peers_dir

LLAMA_CPP_VERSION = "0.3.36"
TEXT = Path(__file__).resolve().parents[1] / "src/llmserve/bench/data/alice_ch1-2.txt"


def parse_llama(text: str) -> dict[str, float]:
    def grab(pattern: str) -> float:
        m = re.search(pattern, text)
        if m is None:
            raise RuntimeError(f"llama-perplexity printed no {pattern!r}")
        return float(m.group(1))

    return {
        "ppl": grab(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)"),
        "kld": grab(r"Mean\s+KLD:\s*([-0-9.e]+)"),
        "top1": grab(r"Same top p:\s*([0-9.]+)") / 100,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--bin", type=Path, default=peers_dir() / f"llama.cpp-{LLAMA_CPP_VERSION}-build/bin")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_quality.json"))
    args = ap.parse_args()
    perplexity, quantize = args.bin / "llama-perplexity", args.bin / "llama-quantize"

    f32 = ensure_f32_gguf()
    files = {"F32": f32, "Q8_0": ensure_quantized_gguf("Q8_0", quantize), "Q4_0": ensure_quantized_gguf("Q4_0", quantize),
             "Q4_1": resolve_model(DEFAULT_MODEL).path,
             "Q4_1 from F32": ensure_quantized_gguf("Q4_1", quantize), "BF16": ensure_quantized_gguf("BF16", quantize)}  # fmt: skip
    reference = load_model(ModelConfig(model=str(f32), quantization="none", show_progress=False))
    ids = load_tokenizer(reference.source).encode(TEXT.read_bytes().decode("utf-8"))

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "f32.kld"
        log = subprocess.run(
            [str(perplexity), "-m", str(f32), "-f", str(TEXT), "-c", str(args.ctx), "-t", "2",
             "--kl-divergence-base", str(base)], check=True, capture_output=True, text=True,
        )  # fmt: skip
        base_ppl = float(re.search(r"Final estimate: PPL = ([0-9.]+)", log.stdout + log.stderr).group(1))
        llama = {}
        for name in ("Q8_0", "Q4_0", "Q4_1", "Q4_1 from F32", "BF16"):
            run = subprocess.run([str(perplexity), "-m", str(files[name]), "-f", str(TEXT), "-c", str(args.ctx), "-t", "2",
                                  "--kl-divergence-base", str(base), "--kl-divergence"], check=True, capture_output=True, text=True)  # fmt: skip
            llama[name] = parse_llama(run.stdout + run.stderr)
        run = subprocess.run([str(perplexity), "-m", str(f32), "-f", str(TEXT), "-c", str(args.ctx), "-t", "2",
                              "--kl-divergence-base", str(base), "--kl-divergence", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"],
                             check=True, capture_output=True, text=True)  # fmt: skip
        llama["F32 + q8_0 KV"] = parse_llama(run.stdout + run.stderr)

    def ours(
        path: Path, quantization: str, kv: torch.dtype | None = None, dtype: str = "auto", act: str = "int16"
    ) -> dict[str, float]:
        config = ModelConfig(model=str(path), quantization=quantization, dtype=dtype, cpu_activations=act, show_progress=False)  # type: ignore[arg-type]  # fmt: skip
        model = load_model(config)
        # the KV cache the server would run (auto: float16 under quantized weights, as llama.cpp's)
        kv = kv or model.kv_cache_dtype("auto")
        r = evaluate(model, ids, args.ctx, reference, kv_cache_dtype=kv)
        return {"ppl": r.ppl, "kld": r.kld, "top1": r.top1, "ref_ppl": r.ref_ppl}

    rows = [  # (what, llama.cpp run, llmserve run)
        ("Q8_0 file (weights as stored)", "Q8_0", ours(files["Q8_0"], "auto")),
        ("8-bit from F32 (llama-quantize Q8_0 / llmserve int8)", "Q8_0", ours(f32, "int8")),
        ("Q4_1 file, the embedded one (weights as stored)", "Q4_1", ours(files["Q4_1"], "auto")),
        (
            "Q4_1 file, llmserve with --cpu-activations int8 (llama.cpp's rounding)",
            "Q4_1",
            ours(files["Q4_1"], "auto", act="int8"),
        ),
        ("Q4_0 file (weights as stored)", "Q4_0", ours(files["Q4_0"], "auto")),
        ("Q4_0 file, llmserve with --cpu-activations int8", "Q4_0", ours(files["Q4_0"], "auto", act="int8")),
        (
            "4-bit from F32 (llama-quantize Q4_1 / llmserve int4, the same math)",
            "Q4_1 from F32",
            ours(f32, "int4"),
        ),
        (
            "BF16 file (llmserve computes in bfloat16, its KV cache too)",
            "BF16",
            ours(files["BF16"], "none", dtype="bfloat16"),
        ),
        ("F32 weights, int8 KV cache (q8_0 / llmserve int8)", "F32 + q8_0 KV", ours(f32, "none", torch.int8)),
    ]
    print(f"text: {TEXT.name}, {len(ids)} tokens, n_ctx {args.ctx}; F32 PPL: llama.cpp {base_ppl:.4f}, "
          f"llmserve {rows[0][2]['ref_ppl']:.4f}")  # fmt: skip
    print(
        "| case | llama.cpp PPL | llama.cpp KLD | llama.cpp same top | llmserve PPL | llmserve KLD | llmserve same top | KLD llmserve / llama.cpp |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    report = []
    for what, lname, mine in rows:
        theirs = llama[lname]
        print(f"| {what} | {theirs['ppl']:.4f} | {theirs['kld']:.6f} | {100 * theirs['top1']:.2f}% | {mine['ppl']:.4f} | "
              f"{mine['kld']:.6f} | {100 * mine['top1']:.2f}% | {mine['kld'] / theirs['kld']:.2f} |")  # fmt: skip
        report.append({"case": what, "llama_cpp": theirs, "llmserve": mine})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"text_tokens": len(ids), "n_ctx": args.ctx, "f32_ppl_llama_cpp": base_ppl, "rows": report},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
