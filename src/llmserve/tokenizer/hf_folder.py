"""Build a `Tokenizer` from a Hugging Face model folder.

Owns: reading `tokenizer.json` (or, when a folder only has the older "slow" files such as
`tokenizer.model` or `vocab.json` + `merges.txt`, converting them with transformers, offline),
the special tokens and `add_bos_token` from `tokenizer_config.json` (BERT's [CLS]/[SEP] from
its post-processor), the chat template from
`chat_template.jinja`, `chat_template.json` or `tokenizer_config.json` (first found wins, as in
transformers), and extra end-of-generation ids from `generation_config.json`.
Does not know: weights or `config.json` model fields.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers

from llmserve.tokenizer.tokenizer import Tokenizer


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _load_backend(folder: Path) -> tokenizers.Tokenizer:
    fast = folder / "tokenizer.json"
    if fast.is_file():
        try:
            backend = tokenizers.Tokenizer.from_file(str(fast))
        except Exception as e:  # the Rust side raises a bare Exception on a malformed file
            raise ValueError(f"cannot read {fast}: {e}") from e
        # A file saved after batched encoding may switch on padding and truncation (all-MiniLM-L6-v2:
        # pad to 128, cut at 128): one text's ids would carry pad ids or lose their end silently.
        # The engine checks lengths itself, so both are off.
        backend.no_padding()
        backend.no_truncation()
        return backend
    # Only slow files: transformers knows how to convert each kind (sentencepiece, vocab+merges,
    # wordpiece). Imported here because it takes seconds and most folders do not need it.
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, ImportError, ... for bad folders
        raise ValueError(
            f"model folder {folder} has no tokenizer.json and transformers cannot load it: {e}"
        ) from e
    backend = getattr(hf, "backend_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer):
        raise ValueError(
            f"model folder {folder}: transformers gave {type(hf).__name__}, which has no Rust backend"
        )
    return backend


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or a serialized AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _ids(value: Any) -> list[int]:
    """`eos_token_id` in a generation config: an int, a list of ints or null."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template") or config.get("chat_template")
    if isinstance(template, list):
        # several named templates ({"name", "template"}): the one named "default" is what plain
        # chat uses; a list without one falls back to its first entry rather than failing
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _prepends_bos(backend: tokenizers.Tokenizer, bos_id: int | None) -> bool:
    """Whether the tokenizer.json post-processor puts BOS first (used when the config is silent)."""
    if bos_id is None:
        return False
    with_special = backend.encode("a", add_special_tokens=True).ids
    without = backend.encode("a", add_special_tokens=False).ids
    return bool(with_special) and with_special[0] == bos_id and (not without or without[0] != bos_id)


def _wraps_cls_sep(backend: tokenizers.Tokenizer, cls_id: int | None, sep_id: int | None) -> bool:
    """Whether the post-processor wraps a text as `[CLS] text [SEP]` (BERT's tokenizers)."""
    if cls_id is None or sep_id is None:
        return False
    ids = backend.encode("a", add_special_tokens=True).ids
    return len(ids) >= 2 and ids[0] == cls_id and ids[-1] == sep_id


def load_hf_tokenizer(folder: Path, name: str) -> Tokenizer:
    """The tokenizer of an HF model folder."""
    config = _read_json(folder / "tokenizer_config.json")
    generation = _read_json(folder / "generation_config.json")
    backend = _load_backend(folder)

    def special_id(key: str) -> int | None:
        content = _token_content(config.get(key))
        token_id = backend.token_to_id(content) if content is not None else None
        if token_id is None:  # no string in the config: the generation config may give the id
            ids = _ids(generation.get(f"{key}_id"))
            token_id = ids[0] if ids else None
        return token_id

    bos_id = special_id("bos_token")
    add_bos = config.get("add_bos_token")
    return Tokenizer(
        backend,
        name=name,
        bos_token_id=bos_id,
        eos_token_id=special_id("eos_token"),
        pad_token_id=special_id("pad_token"),
        add_bos_token=bool(add_bos) if add_bos is not None else _prepends_bos(backend, bos_id),
        chat_template=_chat_template(folder, config),
        # e.g. Llama 3 Instruct: [<|end_of_text|>, <|eom_id|>, <|eot_id|>]; Gemma 3: [<eos>, <end_of_turn>]
        extra_eos_token_ids=_ids(generation.get("eos_token_id")),
        # BERT's [CLS] (no BOS), or RoBERTa's <s> (its BOS and CLS) ... </s>
        wraps_cls_sep=(bos_id is None or bos_id == special_id("cls_token"))
        and _wraps_cls_sep(backend, special_id("cls_token"), special_id("sep_token")),
    )
