"""The `Tokenizer` the engine codes against, and `load_tokenizer`, which picks a loader by source kind.

Owns: text <-> ids for one model (a `tokenizers.Tokenizer` from the HF Rust library), the special
token facts that generation needs (BOS, the set of ids that end generation, padding, whether BOS is
prepended), and the model's chat template.
Does not know: how a vocabulary was stored (see `hf_folder.py`, `gguf_vocab.py`) or anything about
weights; `ModelSource` is only a type here, so this room never imports `model_executor` at run time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import tokenizers

from llmserve.tokenizer.chat_template import ChatTemplate

if TYPE_CHECKING:
    from llmserve.model_executor.model_loader.source import ModelSource


class Tokenizer:
    """Encode, decode and render chat prompts for one model.

    Special tokens: the backend holds control tokens (`<|im_start|>`, `<end_of_turn>`) as added
    tokens marked special, and user-defined ones (Gemma's `<h1>`, runs of spaces) as added tokens
    not marked special. `parse_special=False` spells special ones out as plain text, as llama.cpp
    does; user-defined ones are always matched whole, also as llama.cpp does.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        name: str,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None,
        add_bos_token: bool,
        chat_template: str | None,
        extra_eos_token_ids: Iterable[int] = (),
        wraps_cls_sep: bool = False,
    ) -> None:
        self.name: str = name
        """What the user called the model; used in error messages."""
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = bos_token_id
        self.eos_token_id: int | None = eos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(
            i for i in (eos_token_id, *extra_eos_token_ids) if i is not None
        )
        self.pad_token_id: int | None = pad_token_id
        self.add_bos_token: bool = add_bos_token and bos_token_id is not None
        self.chat_template: str | None = chat_template
        self.wraps_cls_sep: bool = wraps_cls_sep
        """BERT-style: `encode` lets the tokenizer.json post-processor wrap the text as
        `[CLS] text [SEP]` (what an encoder was trained on) instead of the BOS rule."""
        self._backend = backend
        # the backend with special tokens spelled as text; built on first use (a clone of a 262k
        # vocabulary costs memory and most deployments never ask for it)
        self._text_only_backend: tokenizers.Tokenizer | None = None
        self._text_only_lock = threading.Lock()
        self._compiled_template: ChatTemplate | None = None

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying HF `tokenizers.Tokenizer` (vocabulary access, streaming decoders)."""
        return self._backend

    # ---- encode / decode -------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`, with BOS first when `add_special_tokens` and the model asks for it
        (an encoder's [CLS] ... [SEP] when `wraps_cls_sep`).

        BOS is added here rather than by the backend's post-processor so that HF folders and GGUF
        files behave the same and `add_bos_token` is the single source of truth.
        """
        backend = self._backend if parse_special else self._text_only()
        if add_special_tokens and self.wraps_cls_sep:
            return backend.encode(text, add_special_tokens=True).ids
        ids: list[int] = backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            assert self.bos_token_id is not None
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary's spelling of token `i` (byte-level `Ġthe`, sentencepiece `▁the`), or
        None when `i` is outside the vocabulary."""
        return self._backend.id_to_token(i)

    def add_special_tokens(self, tokens: Sequence[tuple[int, str]]) -> None:
        """Add (id, text) special tokens that the stored vocabulary lacks (a GGUF model's image
        placeholder); each must get the id given, the next free one."""
        for token_id, text in tokens:
            if self._backend.token_to_id(text) is not None:
                continue
            self._backend.add_special_tokens([tokenizers.AddedToken(text, special=True, normalized=False)])
            got = self._backend.token_to_id(text)
            if got != token_id:
                raise ValueError(f"token {text!r} was added as id {got}, not {token_id}")
        self.vocab_size = self._backend.get_vocab_size(with_added_tokens=True)
        self._text_only_backend = None

    def _text_only(self) -> tokenizers.Tokenizer:
        if self._text_only_backend is None:
            with self._text_only_lock:
                if self._text_only_backend is None:
                    clone = tokenizers.Tokenizer.from_str(self._backend.to_str())
                    clone.encode_special_tokens = True
                    self._text_only_backend = clone
        return self._text_only_backend

    # ---- chat ------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's chat template; `kwargs` become template variables."""
        if self.chat_template is None:
            raise ValueError(
                f"model {self.name!r} has no chat template; use a completion (raw prompt) request, "
                "or give a model whose tokenizer_config.json / GGUF carries one"
            )
        if self._compiled_template is None:
            self._compiled_template = ChatTemplate(self.chat_template, self._special_token_strings())
        return self._compiled_template.render(messages, add_generation_prompt, **kwargs)

    def _special_token_strings(self) -> dict[str, str]:
        names = {
            "bos_token": self.bos_token_id,
            "eos_token": self.eos_token_id,
            "pad_token": self.pad_token_id,
        }
        strings = {}
        for var, token_id in names.items():
            token = self.id_to_token(token_id) if token_id is not None else None
            if token is not None:
                strings[var] = token
        return strings

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={sorted(self.eos_token_ids)}, add_bos={self.add_bos_token})"
        )


def _load_hf(source: ModelSource) -> Tokenizer:
    from llmserve.tokenizer.hf_folder import load_hf_tokenizer

    return load_hf_tokenizer(source.path, source.name)


def _load_gguf(source: ModelSource) -> Tokenizer:
    from llmserve.tokenizer.gguf_vocab import load_gguf_tokenizer

    return load_gguf_tokenizer(source.gguf_files[0] if source.gguf_files else source.path, source.name)


# ModelSource.kind -> loader. Imports stay inside the loaders: the HF path may import transformers,
# which takes seconds and is not needed for a GGUF.
_LOADERS: dict[str, Callable[[ModelSource], Tokenizer]] = {"hf": _load_hf, "gguf": _load_gguf}


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """The tokenizer of a resolved model; ValueError when its files cannot give one."""
    loader = _LOADERS.get(source.kind)
    if loader is None:
        raise ValueError(f"cannot load a tokenizer for model source kind {source.kind!r}")
    return loader(source)
