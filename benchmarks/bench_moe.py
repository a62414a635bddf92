"""Issue 29's MoE target: batch-1 decode of a mixture-of-experts model against a dense model with
its active parameters, same engine, same machine, one run.

    python benchmarks/bench_moe.py [--model-dir DIR] [--quantization int8 int4] [--decode-tokens 64]
        [--repeats 5] [--out benchmarks/results/moe] [--smoke]

1. models    bench_cpu_scale's `moe` shape (a random Mixtral: hidden 1024, 16 layers, 8 experts of
             2048, 2 per token; 0.90B parameters, 0.29B active) and its dense twin (a Llama with
             one 4096-wide MLP per layer: the same 0.29B), built by transformers, saved in bf16,
             SmolLM2's tokenizer beside them (reused from --model-dir when already built);
2. decode    per --quantization, both models loaded by llmserve (`load_model`, every other setting
             its default), a 128-token prompt prefilled, then --decode-tokens greedy steps at batch
             1 through the runner the engine uses (`ForwardRunner`: the fused C++ decoder where the
             model takes it, layer by layer otherwise); repeats alternate the two models so machine
             noise hits both alike; per repeat the median step time, then the median over repeats;
3. report    ms per token of each, MoE / dense (target: <= 1.3), printed and written to
             OUT/bench_moe.json with the machine, the commands and every repeat.

--smoke: tiny shapes (hidden 64, 2 layers, 4 experts), 2 repeats of 4 tokens: checks the script
in CI; its figures say nothing of speed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from compare import cpu_name
from cpu_scale.plan import SIZES
from gpu.model import build_model
from gpu.plan import SMOKE_SHAPE, ModelShape

TARGET = 1.3
PROMPT_TOKENS = 128


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "llmserve" / "bench_moe")
    ap.add_argument("--quantization", nargs="+", default=["int8", "int4"], choices=["none", "int8", "int4"])
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/moe"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, a few tokens (CI)")
    return ap.parse_args()


def shapes(smoke: bool) -> dict[str, ModelShape]:
    moe = SIZES["moe"]
    if smoke:
        moe = replace(SMOKE_SHAPE, num_local_experts=4, num_experts_per_tok=2)
    return {"moe": moe, "dense": moe.dense_twin()}


def decode_ms(loaded: Any, prompt: list[int], n: int) -> float:
    """The median ms of one batch-1 decode step after prefilling `prompt`."""
    from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry

    bs = 16
    runner = ForwardRunner(loaded.model, num_blocks=-(-(len(prompt) + n + 1) // bs), block_size=bs)
    steps: list[float] = []
    blocks = list(range(runner.num_blocks))
    tok = int(runner.execute([SequenceBatchEntry(prompt, len(prompt), blocks)]).argmax())
    for i in range(n):
        t0 = time.perf_counter()
        tok = int(runner.execute([SequenceBatchEntry([tok], len(prompt) + i + 1, blocks)]).argmax())
        steps.append(time.perf_counter() - t0)
    return 1000 * statistics.median(steps)


def main() -> int:
    args = parse_args()
    import torch

    from llmserve.config import ModelConfig
    from llmserve.model_executor.model_loader import load_model

    folders = {}
    for name, shape in shapes(args.smoke).items():
        folder = args.model_dir / (("smoke-" if args.smoke else "") + name)
        info = build_model(folder, shape, "float32" if args.smoke else "bfloat16")
        folders[name] = folder
        print(
            f"{name}: {folder} ({'reused' if info['reused'] else 'built'}, {info['num_parameters'] / 1e9:.3f}B)"
        )
    n = 4 if args.smoke else args.decode_tokens
    repeats = 2 if args.smoke else args.repeats
    prompt = [(i * 7919) % 1000 + 10 for i in range(PROMPT_TOKENS if not args.smoke else 16)]
    results: dict[str, Any] = {
        "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "platform": platform.platform()},
        "command": " ".join(sys.argv),
        "decode_tokens": n,
        "prompt_tokens": len(prompt),
        "target": f"MoE ms/token <= {TARGET} x dense",
        "runs": {},
    }
    for quant in args.quantization:
        loaded = {
            name: load_model(ModelConfig(model=str(f), quantization=quant, show_progress=False))
            for name, f in folders.items()
        }
        times: dict[str, list[float]] = {name: [] for name in loaded}
        for _ in range(repeats):
            for name, m in loaded.items():
                times[name].append(decode_ms(m, prompt, n))
        med = {name: statistics.median(t) for name, t in times.items()}
        ratio = med["moe"] / med["dense"]
        results["runs"][quant] = {
            "ms_per_token": med,
            "repeats_ms": times,
            "ratio": ratio,
            "met": ratio <= TARGET,
            "load_reports": {name: m.summary() for name, m in loaded.items()},
        }
        print(
            f"{quant:>5}: MoE {med['moe']:.2f} ms/token, dense twin {med['dense']:.2f} ms/token, "
            f"ratio {ratio:.2f} (target <= {TARGET}: {'met' if ratio <= TARGET else 'not met'})"
        )
        print(f"       {loaded['moe'].moe}")
        del loaded
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_moe.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out / 'bench_moe.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
