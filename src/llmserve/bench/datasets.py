"""Benchmark workloads: lists of `BenchRequest` (prompt, its length in tokens, output length).

    random   text made of random token ids, re-encoded until it is exactly `input_len` tokens
    sharegpt first human turn of each conversation; output length = the first answer's tokens
    prefix   one shared text of `prefix_len` tokens + a random per-request suffix of `input_len`

Lengths are counted the way a server counts a completion prompt: `tokenizer.encode(text)`, BOS
included when the model adds one. Cold-cache runs put a per-run `salt` at the very start of each
prompt (of the shared prefix, for `prefix`), so a re-run cannot hit the server's prefix cache.
Does not know: HTTP, engines, timing.
"""

from __future__ import annotations

import json
import logging
import random
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmserve.tokenizer import Tokenizer

logger = logging.getLogger("llmserve.bench")

# decode -> encode rarely needs more than 2 rounds (see `_fit_text`); this bounds a pathological one
_MAX_FIT_ROUNDS = 64


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    """Prompt tokens as the benchmark's tokenizer counts them (BOS included when it adds one)."""
    output_len: int
    """max_tokens to ask for (with EOS ignored, the exact number of output tokens)."""


def load_bench_tokenizer(name_or_path: str | None = None) -> Tokenizer:
    """llmserve's tokenizer for a model folder, .gguf or bundled name (None: the embedded default).

    Reads only tokenizer files / GGUF metadata, never weights.
    """
    # the loader package imports torch, but nothing here reads a tensor
    from llmserve.model_executor.model_loader.source import resolve_model
    from llmserve.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(name_or_path))


def make_salt() -> str:
    """A fresh per-run salt: 8 hex digits, different on every call."""
    return secrets.token_hex(4)


def _token_pool(tokenizer: Tokenizer) -> list[int]:
    """Ids that are plain vocabulary: no added/control tokens (they decode to nothing, or to markers
    that a chat template would parse)."""
    added = set(tokenizer.backend.get_added_tokens_decoder())
    added |= tokenizer.eos_token_ids
    added |= {i for i in (tokenizer.bos_token_id, tokenizer.pad_token_id) if i is not None}
    return [i for i in range(tokenizer.vocab_size) if i not in added]


def _lengths(rng: random.Random, n: int, length: int, range_ratio: float) -> list[int]:
    """n lengths uniform in [length*(1-r), length*(1+r)] (integers, inclusive, at least 1)."""
    lo = max(1, int(length * (1 - range_ratio)))
    hi = max(lo, int(length * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _fit_text(
    tokenizer: Tokenizer, head: str, target: int, rng: random.Random, pool: Sequence[int]
) -> tuple[str, int]:
    """Text = `head` + decoded random tokens, such that `encode(text)` has exactly `target` tokens.

    Decoding random ids and encoding the text again rarely gives the same ids (pieces merge,
    partial UTF-8 becomes U+FFFD), so: encode, then trim the random tail when it came out too long
    or append random ids when too short, and repeat. Returns (text, its length); the length differs
    from `target` only when `head` alone is longer, or after `_MAX_FIT_ROUNDS` (logged).
    """
    num_head = len(tokenizer.encode(head))
    body = [rng.choice(pool) for _ in range(max(0, target - num_head))]
    for _ in range(_MAX_FIT_ROUNDS):
        text = head + tokenizer.decode(body)
        n = len(tokenizer.encode(text))
        if n == target or (n > target and not body):
            return text, n
        if n > target:
            del body[max(0, len(body) - (n - target)) :]
        else:
            body += [rng.choice(pool) for _ in range(target - n)]
    logger.warning("could not fit a prompt to %d tokens; it has %d", target, n)
    return text, n


def _salt_head(salt: str | None) -> str:
    return "" if salt is None else f"{salt} "


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")


def random_requests(
    tokenizer: Tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    salt: str | None = None,
) -> list[BenchRequest]:
    """Prompts of random tokens, each exactly its drawn length in `tokenizer`'s tokens."""
    _check_positive(num_prompts=num_prompts, input_len=input_len, output_len=output_len)
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    input_lens = _lengths(rng, num_prompts, input_len, range_ratio)
    output_lens = _lengths(rng, num_prompts, output_len, range_ratio)
    pool = _token_pool(tokenizer)
    head = _salt_head(salt)
    requests = []
    for n_in, n_out in zip(input_lens, output_lens, strict=True):
        text, n = _fit_text(tokenizer, head, n_in, rng, pool)
        requests.append(BenchRequest(text, n, n_out))
    return requests


def prefix_requests(
    tokenizer: Tokenizer,
    num_prompts: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    salt: str | None = None,
) -> list[BenchRequest]:
    """One shared prefix of `prefix_len` tokens (salted once, at its start), then a random suffix
    of `input_len` tokens per request; every prompt starts with the same prefix text."""
    _check_positive(
        num_prompts=num_prompts, prefix_len=prefix_len, input_len=input_len, output_len=output_len
    )
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    pool = _token_pool(tokenizer)
    prefix, n_prefix = _fit_text(tokenizer, _salt_head(salt), prefix_len, rng, pool)
    input_lens = _lengths(rng, num_prompts, input_len, range_ratio)
    output_lens = _lengths(rng, num_prompts, output_len, range_ratio)
    requests = []
    for n_in, n_out in zip(input_lens, output_lens, strict=True):
        text, n = _fit_text(tokenizer, prefix, n_prefix + n_in, rng, pool)
        requests.append(BenchRequest(text, n, n_out))
    return requests


def _first_exchange(entry: Any) -> tuple[str, str] | None:
    """(first human turn, the gpt answer after it) of one ShareGPT entry, or None."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        return None
    for i, turn in enumerate(turns):
        if isinstance(turn, dict) and turn.get("from") == "human":
            answer = next((t for t in turns[i + 1 :] if isinstance(t, dict) and t.get("from") == "gpt"), None)
            if answer is None:
                return None
            return str(turn.get("value", "")), str(answer.get("value", ""))
    return None


def sharegpt_requests(
    tokenizer: Tokenizer,
    path: str | Path,
    num_prompts: int,
    output_len: int | None = None,
    max_model_len: int = 2048,
    seed: int = 0,
    salt: str | None = None,
) -> list[BenchRequest]:
    """`num_prompts` conversations from a ShareGPT JSON file, sampled with `seed`.

    As vLLM filters them: skip a prompt under 4 tokens, a derived output under 4 tokens, and any
    prompt + output over `max_model_len`. `output_len` overrides the answer's length.
    """
    _check_positive(num_prompts=num_prompts, max_model_len=max_model_len)
    if output_len is not None:
        _check_positive(output_len=output_len)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read ShareGPT dataset {path}: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT dataset is a JSON list of {{'conversations': [...]}}")
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    head = _salt_head(salt)
    requests: list[BenchRequest] = []
    for i in order:  # tokenize lazily: a full ShareGPT file has ~90k conversations
        if len(requests) == num_prompts:
            break
        exchange = _first_exchange(data[i])
        if exchange is None:
            continue
        prompt = head + exchange[0]
        prompt_len = len(tokenizer.encode(prompt))
        n_out = output_len
        if n_out is None:
            n_out = len(tokenizer.encode(exchange[1], add_special_tokens=False))
            if n_out < 4:
                continue
        if prompt_len < 4 or prompt_len + n_out > max_model_len:
            continue
        requests.append(BenchRequest(prompt, prompt_len, n_out))
    if not requests:
        raise ValueError(f"{path}: no conversation passed the length filters (max_model_len {max_model_len})")
    if len(requests) < num_prompts:
        logger.warning(
            "%s: only %d of %d requested prompts passed the filters", path, len(requests), num_prompts
        )
    return requests
