"""Structured outputs over a vocabulary with added special tokens (gpt-oss's harmony markers), on a
tiny random Llama: a grammar's text `<|channel|>` is written in plain pieces, never with the special
token (which a reply decodes to nothing), sampled, greedy and speculative; a Lark grammar that names
the special token gets it. The outside reference is llguidance's own matcher over transformers'
tokenizer (`llguidance.hf.from_tokenizer`): every sampled token must be one it accepts."""

from __future__ import annotations

import re

import llguidance
import llguidance.hf
import pytest
import torch
import transformers

from llmserve import LLM, SamplingParams, StructuredOutputsParams
from llmserve.structured_output import bitmask_words
from tests.models.tiny import make_tiny_model_eos0

SPECIAL = ("<|channel|>", "<|message|>", "<|end|>")  # ids 509, 510, 511
CHANNEL, MESSAGE = 509, 510
REGEX = re.escape("<|channel|>analysis<|message|>") + "[a-z ]{1,12}"
PROMPT = [5, 17, 99, CHANNEL, 3, MESSAGE, 42, CHANNEL, 3, MESSAGE]  # the markers for ngram to propose
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2, "adaptive": False}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("so-special")
    make_tiny_model_eos0(path, SPECIAL)
    return path


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), num_kv_blocks=256, block_size=4, show_progress=False)


@pytest.fixture(scope="module")
def reference(folder) -> llguidance.LLTokenizer:
    """llguidance's tokenizer read from transformers' (the `<|...|>` markers special there too)."""
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    assert hf.convert_tokens_to_ids("<|channel|>") == CHANNEL
    return llguidance.hf.from_tokenizer(hf, n_vocab=512, eos_token=0)


def reference_matcher(reference: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(reference, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def assert_reference_accepts(reference: llguidance.LLTokenizer, grammar: str, tokens: list[int]) -> None:
    """Each token consumed by llguidance's own matcher in turn, and the grammar complete."""
    matcher = reference_matcher(reference, grammar)
    for i, t in enumerate(tokens):
        if t == 0 and i == len(tokens) - 1:  # EOS, once the grammar is complete
            assert matcher.is_accepting(), tokens
            break
        assert matcher.try_consume_tokens([t]) == 1, f"token {t} at {i} of {tokens} refused"
    assert matcher.is_accepting(), tokens


@pytest.mark.parametrize("seed", [None, 0, 7], ids=["greedy", "seed0", "seed7"])
def test_a_constraint_starting_with_a_marker_writes_it_as_text(llm, reference, seed):
    params = SamplingParams(
        temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=60,
        structured_outputs=StructuredOutputsParams(regex=REGEX),
    )  # fmt: skip
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert out.finish_reason == "stop", out
    assert re.fullmatch(REGEX, out.text), out.text
    assert not set(out.token_ids) & {CHANNEL, MESSAGE, 511}
    assert_reference_accepts(reference, llguidance.LLMatcher.grammar_from_regex(REGEX), out.token_ids)


def test_speculative_proposals_of_a_marker_are_refused(folder, reference):
    """ngram proposes the prompt's special markers; verification keeps only what the grammar allows."""
    spec = LLM(str(folder), num_kv_blocks=256, block_size=4, show_progress=False, speculative_config=SPEC)
    grammar = llguidance.LLMatcher.grammar_from_regex(REGEX)
    for seed in (None, 3):
        params = SamplingParams(
            temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=60,
            structured_outputs=StructuredOutputsParams(regex=REGEX),
        )  # fmt: skip
        out = spec.generate([PROMPT], params)[0].outputs[0]
        assert re.fullmatch(REGEX, out.text), out.text
        assert_reference_accepts(reference, grammar, out.token_ids)


def allowed_first(llm: LLM, **constraint) -> set[int]:
    """The tokens our manager's mask allows first under `constraint`."""
    state = llm.engine.structured_outputs.new_state(StructuredOutputsParams(**constraint))
    mask = torch.zeros(bitmask_words(512), dtype=torch.int32)
    state.fill_bitmask(mask)
    return {t for t in range(512) if (int(mask[t // 32]) >> (t % 32)) & 1}


def test_the_first_mask_is_what_the_reference_accepts(llm, reference):
    matcher = reference_matcher(reference, llguidance.LLMatcher.grammar_from_regex(REGEX))
    accepted = set()
    for t in range(512):
        if matcher.try_consume_tokens([t]) == 1:
            accepted.add(t)
            matcher.rollback(1)
    assert CHANNEL not in accepted and accepted
    assert allowed_first(llm, regex=REGEX) == accepted


def test_a_lark_grammar_names_the_special_token(llm, reference):
    grammar = 'start: <|channel|> "analysis"'
    assert allowed_first(llm, grammar=grammar) == {CHANNEL}
    params = SamplingParams(
        temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(grammar=grammar)
    )
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert out.token_ids[0] == CHANNEL and out.text == "analysis"  # the special token decodes to nothing
    assert_reference_accepts(reference, llguidance.LLMatcher.grammar_from_lark(grammar), out.token_ids)


def test_added_tokens_that_decode_as_text_are_text(llm, folder):
    """`<extra_3>` is an added token not marked special: the reply spells it, so the grammar may too."""
    tokenizer = llm.get_tokenizer()
    extra = tokenizer.backend.token_to_id("<extra_3>")
    assert tokenizer.decode([extra]) == "<extra_3>"
    assert allowed_first(llm, regex=re.escape("<extra_3>")) == {extra}  # a fixed text: its own tokens
    assert {extra, 28} <= allowed_first(llm, regex="<extra_3>|<a")  # 28: "<"
    assert CHANNEL not in allowed_first(llm, regex="<.*")
