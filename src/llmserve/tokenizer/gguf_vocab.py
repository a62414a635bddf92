"""Build a `Tokenizer` from the vocabulary a GGUF file carries in its metadata.

Owns: turning llama.cpp's `tokenizer.ggml.*` keys into a `tokenizers.Tokenizer` that splits text
the way llama.cpp does for that file, plus the special-token facts (BOS, end-of-generation ids).
Three vocabulary kinds, chosen by `tokenizer.ggml.model` in `_BUILDERS`:

  gpt2   byte-level BPE (SmolLM2, Llama 3, Qwen2): vocab + merges as stored; the regexes that cut
         text into words before BPE come from `BPE_PRE_TOKENIZERS`, keyed by `tokenizer.ggml.pre`.
  llama  sentencepiece-style BPE (Llama 2, Gemma 3): no merges are stored, only tokens and scores.
         llama.cpp merges the adjacent pair whose joined text is the highest-scoring token, so we
         derive one merge per (left, right) split of every token, ranked by that token's score;
         spaces become "▁", characters outside the vocabulary fall back to `<0xNN>` byte tokens.
  bert   BERT's WordPiece (all-MiniLM, BGE, mxbai-embed-large): the converter's "phantom space"
         spelling undone, BERT's normalizer and pre-tokenizer, `[CLS] text [SEP]` (`_wordpiece`).

Does not know: weights, or what the model does with the ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from llmserve.tokenizer.gguf_metadata import read_gguf_metadata
from llmserve.tokenizer.tokenizer import Tokenizer


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values (llama.cpp's llama_token_type)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


@dataclass(frozen=True, slots=True)
class PreTokenizerSpec:
    """How llama.cpp cuts text into words for one `tokenizer.ggml.pre` value."""

    splits: tuple[str, ...]
    """Regexes applied in order; each one cuts every piece left by the previous one into its
    matches and the text between them (both kept), like llama.cpp's `unicode_regex_split`."""
    ignore_merges: bool = False
    """A word that is itself a token is taken whole before any merge (llama.cpp's ignore_merges)."""
    add_bos: bool = False
    """llama.cpp's default for add_bos when the file has no `tokenizer.ggml.add_bos_token`."""


# Regex patterns as llama.cpp's src/llama-vocab.cpp lists them (data, not code). Case-insensitive
# contractions are spelled out as [sS] etc. there because its regex engine has no (?i:...).
_GPT2_WORDS = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_WORDS = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_WORDS = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_GPT2 = PreTokenizerSpec((_GPT2_WORDS,))
# SmolLM2 (and StarCoder, whose tokenizer it reuses): every digit is its own word before the GPT-2
# regex runs, so "1999" is 1,9,9,9. A plain GPT-2 regex keeps " 1999" together - wrong ids.
_DIGITS_THEN_GPT2 = PreTokenizerSpec((r"\p{N}", _GPT2_WORDS))
_LLAMA3 = PreTokenizerSpec((_LLAMA3_WORDS,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizerSpec((_QWEN2_WORDS,))

BPE_PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    # llama.cpp's fallback for files converted before `pre` existed
    "default": PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_WORDS, r"\p{N}+", r"[0-9][0-9][0-9]")),
    "gpt-2": _GPT2,
    "gpt2": _GPT2,  # not a name llama.cpp writes ("gpt-2" is); accepted as the obvious alias
    "phi-2": _GPT2,
    "mpt": _GPT2,
    "olmo": _GPT2,
    "jais": _GPT2,
    "roberta-bpe": _GPT2,  # RoBERTa encoders (granite-embedding)
    "jina-v1-en": _GPT2,
    "jina-v2-code": _GPT2,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "command-r": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "exaone": _DIGITS_THEN_GPT2,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "falcon3": _LLAMA3,
    "pixtral": _LLAMA3,
    "dbrx": PreTokenizerSpec((_LLAMA3_WORDS,)),
    "smaug-bpe": PreTokenizerSpec((_LLAMA3_WORDS,)),
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "stablelm2": _QWEN2,
    "megrez": _QWEN2,
}

# Token texts llama.cpp treats as end of generation whatever the eos id says (its EOG list).
_END_OF_TURN_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "_<EOT>",
        "<end_of_utterance>",
    }
)

_SPIECE_SPACE = "\u2581"  # "▁", sentencepiece's visible space


@dataclass(frozen=True, slots=True)
class GGUFVocab:
    """The `tokenizer.ggml.*` keys of one file, checked for consistency."""

    path: Path
    model: str
    tokens: list[str]
    token_types: list[int]
    meta: dict[str, Any]

    @classmethod
    def from_metadata(cls, path: Path, meta: dict[str, Any]) -> GGUFVocab:
        model = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if model is None or not tokens:
            raise ValueError(f"GGUF file {path} carries no tokenizer (tokenizer.ggml.model/tokens missing)")
        types = meta.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise ValueError(f"GGUF file {path}: {len(tokens)} tokens but {len(types)} token types")
        return cls(path, model, tokens, types, meta)

    def token_id(self, key: str) -> int | None:
        """A `tokenizer.ggml.<key>` id, or None when absent or outside the vocabulary."""
        value = self.meta.get(f"tokenizer.ggml.{key}")
        return value if isinstance(value, int) and 0 <= value < len(self.tokens) else None

    def first_ids(self) -> dict[str, int]:
        """token text -> id; where a text repeats, the first id wins (as in llama.cpp)."""
        ids: dict[str, int] = {}
        for i, token in enumerate(self.tokens):
            ids.setdefault(token, i)
        return ids


def _byte_level_bpe(vocab: GGUFVocab) -> tuple[BackendTokenizer, bool]:
    pre = vocab.meta.get("tokenizer.ggml.pre") or "default"
    spec = BPE_PRE_TOKENIZERS.get(pre)
    if spec is None:
        raise ValueError(
            f"GGUF file {vocab.path}: unknown tokenizer.ggml.pre {pre!r} for a gpt2 vocabulary "
            f"(known: {', '.join(sorted(BPE_PRE_TOKENIZERS))})"
        )
    token_ids = vocab.first_ids()
    merges = []
    for line in vocab.meta.get("tokenizer.ggml.merges") or ():
        left, _, right = line.partition(" ")
        # the Rust BPE rejects a merge whose parts or result are not tokens; llama.cpp never applies
        # such a merge either, so dropping it changes nothing
        if left in token_ids and right in token_ids and left + right in token_ids:
            merges.append((left, right))
    backend = BackendTokenizer(models.BPE(token_ids, merges, ignore_merges=spec.ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in spec.splits]
        # the regexes above see real characters; only then map bytes to the byte-level alphabet
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend, spec.add_bos


def _score_ranked_merges(vocab: GGUFVocab, token_ids: dict[str, int]) -> list[tuple[str, str]]:
    """Merges that make a BPE behave like llama.cpp's sentencepiece tokenizer.

    llama.cpp starts from characters and repeatedly joins the adjacent pair whose joined text is
    the highest-scoring token (leftmost on ties). A BPE merge list ranked by the score of each
    merge's result does the same: every way to cut a token into two tokens is one merge.
    Only NORMAL tokens are merge results: control and user-defined tokens are matched whole by the
    added-token pass, and must not be rebuilt from pieces when `parse_special=False`.
    """
    scores = vocab.meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(vocab.tokens):
        scores = [-float(i) for i in range(len(vocab.tokens))]  # no scores: earlier tokens first
    lookup = token_ids.get  # ~2M lookups for Gemma's 262k tokens: keep the loop lean
    ranked: list[tuple[float, int, int, int]] = []
    for i, (token, ttype) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True)):
        if ttype != TokenType.NORMAL or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left = lookup(token[:cut])
            if left is None:
                continue
            right = lookup(token[cut:])
            if right is not None:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    return [(vocab.tokens[left], vocab.tokens[right]) for _, _, left, right in ranked]


def _sentencepiece_bpe(vocab: GGUFVocab) -> tuple[BackendTokenizer, bool]:
    token_ids = vocab.first_ids()
    unk_id = vocab.token_id("unknown_token_id")
    model = models.BPE(
        token_ids,
        _score_ranked_merges(vocab, token_ids),
        unk_token=vocab.tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = BackendTokenizer(model)
    # llama.cpp's default for a sentencepiece vocabulary is to add the prefix space (Llama 2);
    # Gemma's files say False. Like llama.cpp, the prefix goes before every run of text that
    # follows a special token, which is what a per-segment normalizer does.
    add_space_prefix = bool(vocab.meta.get("tokenizer.ggml.add_space_prefix", True))
    norm: list[normalizers.Normalizer] = [normalizers.Replace(" ", _SPIECE_SPACE)]
    dec: list[decoders.Decoder] = [
        decoders.Replace(_SPIECE_SPACE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if add_space_prefix:
        norm.insert(0, normalizers.Prepend(_SPIECE_SPACE))
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    backend.normalizer = normalizers.Sequence(norm)
    backend.decoder = decoders.Sequence(dec)
    return backend, True  # llama.cpp adds BOS to sentencepiece vocabularies unless told otherwise


def _wordpiece(vocab: GGUFVocab) -> tuple[BackendTokenizer, bool]:
    """BERT's WordPiece (llama.cpp's `bert` vocabulary). llama.cpp's converter stores it with a
    "phantom space": a word-start piece gains a leading "▁", a continuation loses its "##"
    (control tokens stay as they are); undone here, the HF tokenizer's vocabulary comes back.
    Text is lower-cased (and accents stripped) unless the file says otherwise
    (`tokenizer.ggml.normalizer.lowercase`; llama.cpp lower-cases every WordPiece vocabulary), cut
    at spaces and punctuation as BERT's pre-tokenizer cuts it, and wrapped as `[CLS] text [SEP]`
    (a pair as `[CLS] a [SEP] b [SEP]`, b's token type 1)."""
    pieces: dict[str, int] = {}
    for i, (token, ttype) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True)):
        if ttype == TokenType.CONTROL:
            piece = token
        elif token.startswith(_SPIECE_SPACE):
            piece = token[1:]
        else:
            piece = "##" + token
        pieces.setdefault(piece, i)
    unk_id = vocab.token_id("unknown_token_id")
    unk = vocab.tokens[unk_id] if unk_id is not None else "[UNK]"
    backend = BackendTokenizer(models.WordPiece(pieces, unk_token=unk, continuing_subword_prefix="##"))
    lowercase = bool(vocab.meta.get("tokenizer.ggml.normalizer.lowercase", True))
    backend.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    cls_id = vocab.token_id("cls_token_id") or vocab.token_id("bos_token_id")
    sep_id = vocab.token_id("seperator_token_id") or vocab.token_id("eos_token_id")  # llama.cpp's spelling
    backend.post_processor = _wrap(vocab, cls_id, sep_id, "{o} $A {c} $B:1 {c}:1", "[CLS] and [SEP]")
    return backend, False


def _wrap(
    vocab: GGUFVocab, open_id: int | None, close_id: int | None, pair: str, names: str, flags: bool = False
) -> processors.TemplateProcessing:
    """An encoder's wrapping: `open text close`, a pair as `pair` spells it ({o}, {c}: the tokens).
    `flags`: each of the two only where the file's `add_bos_token` / `add_eos_token` says (default
    true), as llama.cpp adds them to a BPE encoder's input."""
    if open_id is None or close_id is None:
        raise ValueError(f"GGUF file {vocab.path}: a {vocab.model} vocabulary without its {names} ids")
    o, c = vocab.tokens[open_id], vocab.tokens[close_id]
    single = f"{o} $A {c}"
    if flags:
        opens = bool(vocab.meta.get("tokenizer.ggml.add_bos_token", True))
        closes = bool(vocab.meta.get("tokenizer.ggml.add_eos_token", True))
        single = " ".join([o] * opens + ["$A"] + [c] * closes)
    return processors.TemplateProcessing(
        single=single, pair=pair.format(o=o, c=c), special_tokens=[(o, open_id), (c, close_id)]
    )


def _unigram(vocab: GGUFVocab) -> tuple[BackendTokenizer, bool]:
    """A sentencepiece Unigram vocabulary (llama.cpp's `t5`, which its converter writes for the
    XLM-RoBERTa encoders: BGE-M3, multilingual-E5, bge-reranker-v2-m3), built as transformers
    converts XLM-R's sentencepiece model: the pieces with their scores in id order, the model's
    precompiled normalisation (`precompiled_charsmap`: NFKC and friends), whitespace runs
    collapsed (`remove_extra_whitespaces`), "▁" before each word (`add_space_prefix`), and each
    input wrapped as `<s> text </s>`, a pair as `<s> a </s></s> b </s>`."""
    scores = vocab.meta.get("tokenizer.ggml.scores")
    unk_id = vocab.token_id("unknown_token_id")
    if scores is None or len(scores) != len(vocab.tokens) or unk_id is None:
        raise ValueError(f"GGUF file {vocab.path}: a t5 (Unigram) vocabulary needs a score and an unknown id")
    model = models.Unigram([(t, float(x)) for t, x in zip(vocab.tokens, scores, strict=True)], unk_id, False)
    backend = BackendTokenizer(model)
    # llama.cpp's order: the charsmap, then (remove_extra_whitespaces) no space at either end and one
    # for each run, then "▁" for every space and (add_space_prefix) one in front; the pieces are
    # found over the whole text (a piece never holds "▁" past its start, so word by word is the same)
    norm: list[normalizers.Normalizer] = []
    charsmap = vocab.meta.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap:
        norm.append(normalizers.Precompiled(bytes(int(b) & 0xFF for b in charsmap)))
    if vocab.meta.get("tokenizer.ggml.remove_extra_whitespaces", True):
        norm += [normalizers.Strip(left=True, right=True), normalizers.Replace(Regex(" {2,}"), " ")]
    norm.append(normalizers.Replace(" ", _SPIECE_SPACE))
    prefix = bool(vocab.meta.get("tokenizer.ggml.add_space_prefix", True))
    if prefix:
        norm.append(normalizers.Prepend(_SPIECE_SPACE))
    backend.normalizer = normalizers.Sequence(norm)
    backend.decoder = decoders.Metaspace(
        replacement=_SPIECE_SPACE, prepend_scheme="always" if prefix else "never", split=True
    )
    bos_id, eos_id = vocab.token_id("bos_token_id"), vocab.token_id("eos_token_id")
    backend.post_processor = _wrap(vocab, bos_id, eos_id, "{o} $A {c} {c} $B {c}", "<s> and </s>")
    return backend, False


_ENCODERS = frozenset({"bert", "nomic-bert", "modern-bert"})
"""GGUF architectures that are encoders: an input is wrapped whatever its vocabulary's kind."""

# tokenizer.ggml.model -> builder returning (backend, default for add_bos_token)
_BUILDERS: dict[str, Callable[[GGUFVocab], tuple[BackendTokenizer, bool]]] = {
    "gpt2": _byte_level_bpe,
    "llama": _sentencepiece_bpe,
    "bert": _wordpiece,
    "t5": _unigram,
}


def _add_special_tokens(backend: BackendTokenizer, vocab: GGUFVocab) -> None:
    """Control (and unknown) tokens become special added tokens: matched whole when parsing
    special tokens, spelled out otherwise, dropped by decode(skip_special_tokens=True).
    User-defined tokens become plain added tokens: always matched whole (llama.cpp does the same),
    always decoded. Their text is already in the vocabulary, so each keeps its GGUF id."""
    special, plain = [], []
    for token, ttype in zip(vocab.tokens, vocab.token_types, strict=True):
        if not token:
            continue
        if ttype in (TokenType.CONTROL, TokenType.UNKNOWN):
            special.append(AddedToken(token, special=True, normalized=False))
        elif ttype == TokenType.USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False))
    backend.add_special_tokens(special)
    backend.add_tokens(plain)


def _end_of_generation_ids(vocab: GGUFVocab) -> set[int]:
    """eos, eot and eom ids, plus every non-normal token whose text llama.cpp treats as an end
    of turn: Gemma's files name only `<eos>` but the model ends each turn with `<end_of_turn>`."""
    keyed = (vocab.token_id(key) for key in ("eos_token_id", "eot_token_id", "eom_token_id"))
    ids = {i for i in keyed if i is not None}
    ids.update(
        i
        for i, (token, ttype) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True))
        if ttype != TokenType.NORMAL and token in _END_OF_TURN_TEXTS
    )
    return ids


def load_gguf_tokenizer(path: Path, name: str) -> Tokenizer:
    """The tokenizer described by the metadata of `path` (the first part of a split GGUF)."""
    vocab = GGUFVocab.from_metadata(path, read_gguf_metadata(path))
    builder = _BUILDERS.get(vocab.model)
    if builder is None:
        raise ValueError(
            f"GGUF file {path}: unsupported tokenizer.ggml.model {vocab.model!r} "
            f"(supported: {', '.join(sorted(_BUILDERS))})"
        )
    backend, default_add_bos = builder(vocab)
    _add_special_tokens(backend, vocab)
    # [CLS] ... [SEP] (or <s> ... </s>) by the post-processor, not a BOS rule
    wraps_cls_sep = vocab.model in ("bert", "t5")
    arch = vocab.meta.get("general.architecture")
    if vocab.model == "gpt2" and arch in _ENCODERS:
        # an encoder's byte-level BPE: RoBERTa's <s> text </s> (granite-embedding), ModernBERT's
        # [CLS] text [SEP], as llama.cpp adds them; a pair as the HF tokenizer writes it
        open_id = vocab.token_id("cls_token_id") or vocab.token_id("bos_token_id")
        close_id = vocab.token_id("seperator_token_id") or vocab.token_id("eos_token_id")
        pair = "{o} $A {c} $B {c}" if arch == "modern-bert" else "{o} $A {c} {c} $B {c}"
        backend.post_processor = _wrap(vocab, open_id, close_id, pair, "opening and closing", flags=True)
        wraps_cls_sep = True
    return Tokenizer(
        backend,
        name=name,
        bos_token_id=None if wraps_cls_sep else vocab.token_id("bos_token_id"),
        eos_token_id=vocab.token_id("eos_token_id"),
        pad_token_id=vocab.token_id("padding_token_id"),
        add_bos_token=bool(vocab.meta.get("tokenizer.ggml.add_bos_token", default_add_bos)),
        chat_template=vocab.meta.get("tokenizer.chat_template"),
        extra_eos_token_ids=_end_of_generation_ids(vocab),
        wraps_cls_sep=wraps_cls_sep,
    )
