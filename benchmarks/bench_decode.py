"""Batch-1 prefill and greedy decode speed of the embedded model: llmserve next to transformers,
same weights (the GGUF dequantized to float32), same prompt, same machine, in one run. llmserve
runs twice: with its default CPU matmul (oneDNN, when usable) and with `cpu_gemm="blas"` (MKL).

    python benchmarks/bench_decode.py [--prompt-tokens 256] [--decode-tokens 128] [--repeats 3]

Prints a table and writes benchmarks/results/bench_decode.json. Runs of the two engines are
interleaved so machine noise hits both alike; figures are medians over repeats.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from llmserve.config import ModelConfig
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.model_loader import load_model
from llmserve.tokenizer import load_tokenizer

TEXT = (
    "The history of computing is a story of ideas meeting machines. Early mechanical calculators "
    "gave way to electronic computers, and each generation brought faster memory, denser logic and "
    "new ways to program. "
)


def llmserve_run(runner: ForwardRunner, prompt: list[int], n_decode: int) -> tuple[float, float, list[int]]:
    """(prefill s, decode s for n_decode tokens, generated ids)."""
    bs = runner.block_size
    blocks = list(range((len(prompt) + n_decode + bs - 1) // bs))
    t0 = time.perf_counter()
    tok = int(runner.execute([SequenceBatchEntry(prompt, len(prompt), blocks)]).argmax())
    t1 = time.perf_counter()
    out = [tok]
    for i in range(n_decode):
        logits = runner.execute([SequenceBatchEntry([tok], len(prompt) + i + 1, blocks)])
        tok = int(logits.argmax())
        out.append(tok)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, out


@torch.inference_mode()
def transformers_run(model, prompt: list[int], n_decode: int) -> tuple[float, float, list[int]]:
    t0 = time.perf_counter()
    # logits_to_keep=1: like generate(), project only the last position to the vocabulary
    res = model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
    tok = int(res.logits[0, -1].argmax())
    t1 = time.perf_counter()
    out, past = [tok], res.past_key_values
    for _ in range(n_decode):
        res = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = res.past_key_values
        tok = int(res.logits[0, -1].argmax())
        out.append(tok)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF path or bundled name (default: embedded SmolLM2)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="weights and activations, every engine",
    )
    ap.add_argument("--out", default="benchmarks/results/bench_decode.json")
    args = ap.parse_args()

    loaded = load_model(ModelConfig(model=args.model, dtype=args.dtype, show_progress=False))
    tok = load_tokenizer(loaded.source)
    prompt = (tok.encode(TEXT * 40, add_special_tokens=False))[: args.prompt_tokens]
    num_blocks = (args.prompt_tokens + args.decode_tokens) // 16 + 2
    runners = {f"llmserve ({loaded.linear_kernel})": ForwardRunner(loaded.model, num_blocks=num_blocks)}
    if loaded.linear_kernel != "blas":
        blas = load_model(
            ModelConfig(model=args.model, dtype=args.dtype, cpu_gemm="blas", show_progress=False)
        )
        runners["llmserve (blas)"] = ForwardRunner(blas.model, num_blocks=num_blocks)

    from transformers import AutoModelForCausalLM

    gguf = loaded.source.gguf_files[0]
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, args.dtype)
    ).eval()

    engines = {name: partial(llmserve_run, runner) for name, runner in runners.items()}
    engines["transformers"] = partial(transformers_run, hf)
    results: dict[str, dict[str, list[float]]] = {name: {} for name in engines}
    outputs: dict[str, list[int]] = {}
    # Warm up every engine (first calls allocate and pick kernels), then interleave timed repeats.
    for fn in engines.values():
        fn(prompt, 4)
    for _ in range(args.repeats):
        for name, fn in engines.items():
            pre, dec, out = fn(prompt, args.decode_tokens)
            results[name].setdefault("prefill_tok_s", []).append(len(prompt) / pre)
            results[name].setdefault("decode_tok_s", []).append(args.decode_tokens / dec)
            outputs[name] = out

    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in results.items()}
    same = all(out == outputs["transformers"] for out in outputs.values())
    print(
        f"model {loaded.source.name}, {len(prompt)} prompt tokens, {args.decode_tokens} decode tokens, "
        f"batch 1, {args.dtype}, {torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print(f"{'engine':<20}{'prefill tok/s':>15}{'decode tok/s':>14}{'÷ transformers':>22}")
    ref = med["transformers"]
    for n, m in med.items():
        ratio = f"{m['prefill_tok_s'] / ref['prefill_tok_s']:.2f}x / {m['decode_tok_s'] / ref['decode_tok_s']:.2f}x"
        print(f"{n:<20}{m['prefill_tok_s']:>15.1f}{m['decode_tok_s']:>14.1f}{ratio:>22}")
    print(f"greedy tokens identical across engines: {same}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(),
                "prompt_tokens": len(prompt),
                "decode_tokens": args.decode_tokens,
                "runs": results,
                "median": med,
                "greedy_identical": same,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
