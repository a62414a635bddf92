"""Constrained decoding libraries side by side on CPU: llguidance, xgrammar, outlines-core.

Why the project uses llguidance. This script is standalone; run it in a venv that has the three
libraries (the project itself depends only on llguidance):

  pip install llguidance outlines-core xgrammar  # (+ torch and tokenizers, which xgrammar pulls in)
  python benchmarks/bench_grammar_libs.py [--tokenizer tokenizer.json | --model NAME] [--walks 3]

The vocabulary comes from an HF `tokenizers` JSON (--tokenizer), or is exported from llmserve's
loader (--model, when llmserve is importable). For each library and each schema of
structured_schemas.py (those of bench_structured.py):

- tokenizer setup: once per library (LLTokenizer; xgrammar TokenizerInfo + GrammarCompiler;
  outlines-core Vocabulary), reported apart;
- compile: schema to a ready matcher (LLMatcher; compile_json_schema + GrammarMatcher;
  build_regex_from_schema + Index + Guide), no cache (xgrammar's compiler is built with
  cache_enabled=False; the other two have no cross-schema cache at this level);
- mask: a hand-written valid instance of the schema, serialized compactly (json.dumps: ', ' and
  ': '), is walked token by token with the tokenizer's own encoding; before each token (and once
  more at the end, for EOS) the full-vocabulary bitmask is computed (timed) and the token is
  checked against it and consumed. --walks walks per schema: the first on the fresh matcher
  (cold), the rest after a reset. Median and p99 are over all masks of all schemas.

Whitespace: llguidance and xgrammar are told the compact separators; outlines-core has no
separator option and its default whitespace pattern (`[ ]?`) accepts them. Single-threaded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import llguidance
import outlines_core
import tokenizers
import torch
import xgrammar

from structured_schemas import INSTANCES, SCHEMAS

ITEM_SEP, KEY_SEP = ", ", ": "
LIBS = ("llguidance", "xgrammar", "outlines-core")


class Vocab:
    """The tokenizer JSON, its encoder, vocabulary size, EOS ids and per-id token strings."""

    def __init__(self, json_str: str, vocab_size: int | None, eos: list[int]) -> None:
        self.json_str = json_str
        self.backend = tokenizers.Tokenizer.from_str(json_str)
        self.size = vocab_size or self.backend.get_vocab_size(with_added_tokens=True)
        self.eos = eos
        spec = json.loads(json_str)
        self.special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        decoder = json.dumps(spec.get("decoder"))
        self.kind = "byte_level" if "ByteLevel" in decoder else "raw"
        if "ByteFallback" in decoder:
            self.kind = "byte_fallback"
        self.tokens = [""] * self.size
        for tok, i in self.backend.get_vocab(with_added_tokens=True).items():
            if i < self.size:
                self.tokens[i] = tok

    def token_bytes(self, i: int) -> bytes:
        """The bytes a token stands for (byte-level BPE or SentencePiece byte fallback)."""
        tok = self.tokens[i]
        if self.kind == "byte_level":
            return bytes(_BYTE_DECODER[c] for c in tok)
        if self.kind == "byte_fallback" and len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            return bytes([int(tok[3:5], 16)])
        return tok.replace("\u2581", " ").encode()


def _gpt2_byte_decoder() -> dict[str, int]:
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = _gpt2_byte_decoder()


def load_vocab(args: argparse.Namespace) -> Vocab:
    eos = [int(x) for x in args.eos.split(",")] if args.eos else None
    if args.model is not None:
        try:
            from llmserve.model_executor.model_loader.source import resolve_model
            from llmserve.tokenizer import load_tokenizer
        except ImportError as e:
            raise SystemExit(f"--model needs llmserve importable in this venv ({e}); use --tokenizer") from e

        tok = load_tokenizer(resolve_model(args.model or None))
        return Vocab(
            tok.backend.to_str(), args.vocab_size or tok.vocab_size, eos or sorted(tok.eos_token_ids)
        )
    return Vocab(Path(args.tokenizer).read_text(), args.vocab_size, eos or [0, 2])


# ---- one adapter per library: setup(vocab), compile(schema) -> matcher, mask(matcher, buf), ... ----


class LLGuidance:
    def __init__(self, v: Vocab) -> None:
        self.tok = llguidance.LLTokenizer(v.json_str, n_vocab=v.size, eos_token=v.eos)

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema,
            overrides={"whitespace_flexible": False, "item_separator": ITEM_SEP, "key_separator": KEY_SEP},
        )
        matcher = llguidance.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    @staticmethod
    def buffer(v: Vocab) -> torch.Tensor:
        return torch.zeros((v.size + 31) // 32, dtype=torch.int32)

    @staticmethod
    def mask(m: Any, buf: torch.Tensor) -> None:
        m.unsafe_compute_mask_ptr(buf.data_ptr(), buf.numel() * 4)

    @staticmethod
    def consume(m: Any, token: int) -> bool:
        return bool(m.consume_token(token))

    @staticmethod
    def reset(m: Any) -> None:
        m.reset()


class XGrammar:
    def __init__(self, v: Vocab) -> None:
        kinds = {"byte_level": "BYTE_LEVEL", "byte_fallback": "BYTE_FALLBACK", "raw": "RAW"}
        vocab_type = getattr(xgrammar.VocabType, kinds[v.kind])
        # special tokens as empty strings: xgrammar then treats them as special (never inside JSON)
        encoded = ["" if i in v.special else t for i, t in enumerate(v.tokens)]
        self.info = xgrammar.TokenizerInfo(encoded, vocab_type, vocab_size=v.size, stop_token_ids=v.eos)
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def compile(self, schema: dict[str, Any]) -> Any:
        compiled = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(ITEM_SEP, KEY_SEP)
        )
        return xgrammar.GrammarMatcher(compiled)

    @staticmethod
    def buffer(v: Vocab) -> torch.Tensor:
        return xgrammar.allocate_token_bitmask(1, v.size)

    @staticmethod
    def mask(m: Any, buf: torch.Tensor) -> None:
        m.fill_next_token_bitmask(buf)

    @staticmethod
    def consume(m: Any, token: int) -> bool:
        return bool(m.accept_token(token))

    @staticmethod
    def reset(m: Any) -> None:
        m.reset()


class OutlinesCore:
    def __init__(self, v: Vocab) -> None:
        # Vocabulary takes one EOS id and a map of token text -> ids, EOS and special tokens left out
        table: dict[bytes, list[int]] = {}
        for i, tok in enumerate(v.tokens):
            if tok and i not in v.special and i not in v.eos:
                table.setdefault(v.token_bytes(i), []).append(i)
        self.vocab = outlines_core.Vocabulary(v.eos[0], table)

    def compile(self, schema: dict[str, Any]) -> Any:
        regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(schema))
        return outlines_core.Guide(outlines_core.Index(regex, self.vocab))

    @staticmethod
    def buffer(v: Vocab) -> torch.Tensor:
        return torch.zeros((v.size + 31) // 32, dtype=torch.int32)

    @staticmethod
    def mask(m: Any, buf: torch.Tensor) -> None:
        m.write_mask_into(buf.data_ptr(), buf.numel(), 4)

    @staticmethod
    def consume(m: Any, token: int) -> bool:
        m.advance(token, False)
        return True

    @staticmethod
    def reset(m: Any) -> None:
        m.reset()


ADAPTERS = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines-core": OutlinesCore}


def allowed(buf: torch.Tensor, token: int) -> bool:
    return bool((int(buf.view(-1)[token >> 5]) >> (token & 31)) & 1)


def measure(lib: str, v: Vocab, walks: int) -> dict[str, Any]:
    adapter_cls = ADAPTERS[lib]
    start = time.perf_counter()
    adapter = adapter_cls(v)
    setup_s = time.perf_counter() - start
    compile_s: dict[int, float] = {}  # schema number -> seconds
    first_mask_s, masks, notes = [], [], []
    buf = adapter_cls.buffer(v)
    for si, (schema, instance) in enumerate(zip(SCHEMAS, INSTANCES, strict=True)):
        text = json.dumps(instance)
        ids = v.backend.encode(text, add_special_tokens=False).ids
        try:
            start = time.perf_counter()
            matcher = adapter.compile(schema)
            compile_s[si + 1] = time.perf_counter() - start
        except Exception as e:  # a library that cannot compile a schema: say so, go on
            notes.append(f"schema {si + 1}: compile failed ({type(e).__name__}: {str(e)[:60]})")
            continue
        for walk in range(walks):
            if walk:
                adapter.reset(matcher)
            for k in range(len(ids) + 1):
                t0 = time.perf_counter_ns()
                adapter.mask(matcher, buf)
                dt = (time.perf_counter_ns() - t0) / 1e9
                masks.append(dt)
                if walk == 0 and k == 0:
                    first_mask_s.append(dt)
                if k == len(ids):
                    if walk == 0 and not any(allowed(buf, e) for e in v.eos):
                        notes.append(f"schema {si + 1}: EOS not allowed at the end")
                    break
                tok = ids[k]
                if not allowed(buf, tok) or not adapter.consume(matcher, tok):
                    if walk == 0:
                        notes.append(f"schema {si + 1}: token {k} {v.tokens[tok]!r} rejected")
                    break
    return {"setup": setup_s, "compile": compile_s, "first": first_mask_s, "masks": masks, "notes": notes}


def package_mb(module: Any) -> float:
    root = Path(module.__file__).parent
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default="/tmp/smollm2_tokenizer.json", help="HF tokenizers JSON")
    ap.add_argument(
        "--model",
        nargs="?",
        const="",
        default=None,
        help="export the tokenizer from llmserve (bare: default model)",
    )
    ap.add_argument("--vocab-size", type=int, default=None, help="mask width (default: the tokenizer's)")
    ap.add_argument("--eos", default=None, help="comma-separated EOS ids (default: 0,2 or llmserve's)")
    ap.add_argument("--walks", type=int, default=3, help="walks of each instance (first one cold)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    v = load_vocab(args)
    print(
        f"vocabulary {v.size} tokens ({v.kind}), EOS {v.eos}; {len(SCHEMAS)} schemas x {args.walks} walks\n"
    )

    print("| library | tokenizer setup ms | compile ms median / max | mask us median / p99 | notes |")
    print("|---|---|---|---|---|")
    for lib in LIBS:
        r = measure(lib, v, args.walks)
        masks = sorted(r["masks"])
        p99 = masks[min(len(masks) - 1, int(0.99 * len(masks)))]
        compile_s = list(r["compile"].values())
        compile_ms = "n/a"
        notes = [f"v{version(lib)}"]
        if compile_s:
            compile_ms = f"{1e3 * statistics.median(compile_s):.2f} / {1e3 * max(compile_s):.2f}"
            notes.append(f"slowest compile: schema {max(r['compile'], key=r['compile'].__getitem__)}")
        if r["first"]:
            notes.append(f"first mask median {1e3 * statistics.median(r['first']):.2f} ms")
        notes += [f"{len(masks)} masks", *r["notes"]]
        mask_us = f"{1e6 * statistics.median(masks):.0f} / {1e6 * p99:.0f}"
        print(f"| {lib} | {1e3 * r['setup']:.0f} | {compile_ms} | {mask_us} | {'; '.join(notes)} |")

    sizes = {m.__name__: package_mb(m) for m in (llguidance, xgrammar, outlines_core)}
    try:
        import tvm_ffi

        sizes["tvm_ffi (xgrammar dep)"] = package_mb(tvm_ffi)
    except ImportError:
        pass
    try:
        import triton

        sizes["triton"] = package_mb(triton)
    except ImportError:
        sizes["triton"] = 0.0
    listed = ", ".join(f"{k} {mb:.1f}" if mb else f"{k} not installed" for k, mb in sizes.items())
    print(f"\ninstalled package directories (MB): {listed}")


if __name__ == "__main__":
    main()
