"""The llguidance view of a model's vocabulary: what each token id spells, which ids are special
(control tokens that are no text), and how a piece of text is tokenized.

Special tokens are never text under a grammar. A reply is decoded with `skip_special_tokens`
on by default, where `<|channel|>` the special token adds nothing to the text, so a grammar's
literal `<|channel|>` is written with the plain pieces `<`, `|`, `channel`, ... and the special
token is forbidden. (With `skip_special_tokens` off both spell the same text, so nothing is lost.)
A Lark grammar that wants the special token itself names it: `start: <|channel|> "a"`.

Why not `LLTokenizer(tokenizer.json)`: llguidance keeps special tokens out of its text trie
(their bytes carry a 0xFF prefix), but tokenizes forced text with the HF tokenizer, which always
matches added tokens. A grammar forcing `<|channel|>...` then got the mask {`<|channel|>`} while
the matcher refused that very token; the sampled token put the matcher in its error state, where
only EOS is allowed, and the reply ended. Here the text is tokenized with the special tokens
spelled out (`Tokenizer.encode(parse_special=False)`), which agrees with the trie; and only the
ids the tokenizer marks special are special (llguidance's own reading marks every added token
special, so Gemma's `<h1>` or a padding `<extra_0>`, which decode as text, could never be written;
ids past the tokenizer's, where a model pads its head, stay special: never allowed).
"""

from __future__ import annotations

import llguidance

from llmserve.tokenizer import Tokenizer


class _Vocabulary:
    """What `llguidance.TokenizerWrapper` reads: each id's bytes, the special ids, EOS/BOS, and
    text -> ids."""

    def __init__(self, tokenizer: Tokenizer, parsed: llguidance.LLTokenizer) -> None:
        self._tokenizer = tokenizer
        # llguidance's own decoding of each id (byte-level, sentencepiece and byte-fallback
        # pieces -> bytes), read back with the special prefix left out
        self.tokens = [parsed.decode_bytes([t]) for t in range(parsed.vocab_size)]
        # llguidance's special ids (added tokens, ids past the tokenizer's: never allowed as
        # text) less the added tokens the tokenizer decodes as text
        added = tokenizer.backend.get_added_tokens_decoder()
        self.special_token_ids = [
            t
            for t in range(parsed.vocab_size)
            if parsed.is_special_token(t) and (t not in added or added[t].special)
        ]
        self.eos_token_id = parsed.eos_token
        self.bos_token_id = tokenizer.bos_token_id

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # TokenizerWrapper probes for bytes input: text only
            raise TypeError("text is str")
        return self._tokenizer.encode(text, add_special_tokens=False, parse_special=False)


def build_ll_tokenizer(
    tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]
) -> llguidance.LLTokenizer:
    """`tokenizer`'s vocabulary for llguidance, `vocab_size` ids wide (the model's logits: ids past
    the tokenizer's are never allowed); EOS = `eos_token_ids`. ~0.1-1 s: build once."""
    eos = eos_token_ids or None
    parsed = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    wrapper = llguidance.TokenizerWrapper(_Vocabulary(tokenizer, parsed))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)
