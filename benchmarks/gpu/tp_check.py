"""Issue 25's tensor parallelism on CUDA (NCCL), checked where GPUs are: rank r on cuda:r.

    python benchmarks/gpu/tp_check.py [--size 2] [--out DIR]

1. gpus      how many GPUs CUDA_VISIBLE_DEVICES shows; with fewer than --size, the engine must
             refuse TP=--size with the ValueError that names the count (checked), and the
             parity checks below are reported as not run (one GPU cannot hold two NCCL ranks);
2. models    tiny random float32 Llama and Mixtral folders (transformers' config classes,
             save_pretrained), their tokenizer a byte-level BPE trained on the spot;
3. parity    per model, greedy tokens (and their logprobs) of four prompts at TP=1 on cuda:0 and
             at TP=--size (NCCL all-reduces, vocab-parallel embedding, gathered LM head, experts
             split on their intermediate dimension): tokens must be equal, logprobs within 1e-3;
4. report    one line per check, printed and written to OUT/tp_check.json; exit 1 if a check
             failed.

Not a benchmark: it times nothing. The CPU tests (tests/unit/test_tp_placement.py) cover the
placement and its refusals without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

PROMPTS = [
    [200, 1, 1, 45, 67, 300, 12, 9, 25],
    [5, 17, 99, 3],
    [200, 1, 1, 45, 67, 30],
    [7, 8, 9, 10, 11, 12],
]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=2, help="tensor_parallel_size to check")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu"))
    return ap.parse_args()


def build_models(root: Path) -> dict[str, Path]:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    common = dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, initializer_range=0.15, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    configs = {
        "llama": transformers.LlamaConfig(**common),
        "mixtral": transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2),
    }
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"])
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. 0123456789"] * 50, trainer)
    tok.add_tokens([f"<extra_{i}>" for i in range(512 - tok.get_vocab_size())])
    folders = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        folder = root / name
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
        folders[name] = folder
    return folders


def generate(folder: Path, size: int) -> tuple[list[list[int]], list[list[float]]]:
    from llmserve import LLM
    from llmserve.sampling_params import SamplingParams

    llm = LLM(str(folder), device="cuda", dtype="float32", tensor_parallel_size=size, show_progress=False)
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=1, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.engine.close()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [
        [lp[t][0] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)] for o in outs
    ]
    return tokens, logprobs


def main() -> int:
    args = parse_args()
    import torch

    checks: list[dict[str, Any]] = []
    gpus = torch.cuda.device_count()
    print(f"{gpus} GPU(s) visible; checking tensor_parallel_size {args.size}")
    with tempfile.TemporaryDirectory() as tmp:
        folders = build_models(Path(tmp))
        if gpus < args.size:
            try:
                generate(folders["llama"], args.size)
                checks.append({"check": "refusal", "ok": False, "detail": "TP ran with too few GPUs"})
            except ValueError as e:
                ok = f"needs {args.size} GPUs" in str(e)
                checks.append({"check": "refusal", "ok": ok, "detail": str(e)})
            checks.append({"check": "parity", "ok": None, "detail": f"not run: {gpus} GPU(s) < {args.size}"})
        else:
            for name, folder in folders.items():
                ref_tokens, ref_lp = generate(folder, 1)
                tp_tokens, tp_lp = generate(folder, args.size)
                diff = max(
                    abs(a - b) for x, y in zip(tp_lp, ref_lp, strict=True) for a, b in zip(x, y, strict=True)
                )
                ok = tp_tokens == ref_tokens and diff < 1e-3
                checks.append({"check": f"parity {name}", "ok": ok, "detail": f"max logprob diff {diff:.2e}"})
    for c in checks:
        print(f"{c['check']:16s} {'-' if c['ok'] is None else 'ok' if c['ok'] else 'FAILED'}  {c['detail']}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tp_check.json").write_text(
        json.dumps({"gpus": gpus, "size": args.size, "checks": checks}, indent=1)
    )
    return 1 if any(c["ok"] is False for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
