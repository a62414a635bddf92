"""A draft model for speculative decoding benchmarks: the first N layers of the embedded
SmolLM2-135M-Instruct (dequantized from its GGUF), with its final norm and (tied) LM head, as an
HF folder. It shares the target's vocabulary and embeddings and costs about N/30 of a step; it
was never trained to stop early, so its proposals are rough (an early-exit draft).

    python benchmarks/make_draft.py --layers 6 --out benchmarks/results/draft-l6
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from llmserve.model_executor.model_loader.gguf_loader import GGUFCheckpoint
from llmserve.model_executor.model_loader.source import DEFAULT_MODEL, resolve_model

LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "draft-l6")
    args = p.parse_args()
    source = resolve_model(DEFAULT_MODEL)
    ckpt = GGUFCheckpoint(source.gguf_files)
    config = ckpt.hf_config()
    if not 1 <= args.layers <= config.num_hidden_layers:
        raise SystemExit(f"--layers must be in [1, {config.num_hidden_layers}]")
    tensors = {}
    for name, tensor, _file in ckpt.iter_weights(torch.float32):
        m = LAYER.match(name)
        if m is None or int(m.group(1)) < args.layers:
            tensors[name] = tensor.contiguous()
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out / "model.safetensors"))
    data = config.to_dict()
    data["num_hidden_layers"] = args.layers
    (args.out / "config.json").write_text(json.dumps(data, indent=2))
    print(f"wrote {args.out}: {args.layers} of {config.num_hidden_layers} layers, {len(tensors)} tensors")


if __name__ == "__main__":
    main()
