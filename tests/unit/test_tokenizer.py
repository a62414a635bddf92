"""The tokenizer room against references: llama.cpp's ids for the embedded SmolLM2 GGUF, transformers'
GGUF tokenizer for Gemma 3, HF folders built in tmp_path, and GGUF files that should be refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from tokenizers import pre_tokenizers

from llmserve.model_executor.model_loader.errors import ModelNotFoundError
from llmserve.model_executor.model_loader.source import resolve_model
from llmserve.tokenizer import Tokenizer, load_tokenizer
from llmserve.tokenizer.gguf_vocab import BPE_PRE_TOKENIZERS

REFERENCE = Path("/work/shared/testdata/smollm2-135m-llamacpp.json")
_REF = json.loads(REFERENCE.read_text()) if REFERENCE.is_file() else {"tokenize": [], "greedy": []}
_CHATS = list({g["prompt"]: g for g in _REF["greedy"] if g["kind"] == "chat"}.values())


def _load_bundled(name: str | None) -> Tokenizer:
    try:
        return load_tokenizer(resolve_model(name))
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return _load_bundled(None)


# ---- SmolLM2 (byte-level BPE, pre "smollm") vs llama.cpp -------------------------------------


@pytest.mark.parametrize(
    "case",
    _REF["tokenize"],
    ids=[f"{i}-{'special' if c['parse_special'] else 'text'}" for i, c in enumerate(_REF["tokenize"])],
)
def test_smollm2_tokenize_matches_llamacpp(smollm2: Tokenizer, case: dict) -> None:
    ids = smollm2.encode(case["text"], add_special_tokens=False, parse_special=case["parse_special"])
    assert ids == case["ids"]
    assert smollm2.decode(ids, skip_special_tokens=False) == case["text"]


@pytest.mark.parametrize("case", _CHATS, ids=[c["prompt"][:20] for c in _CHATS])
def test_smollm2_chat_prompt_matches_llamacpp(smollm2: Tokenizer, case: dict) -> None:
    prompt = smollm2.apply_chat_template([{"role": "user", "content": case["prompt"]}])
    assert prompt == case["prompt_text"]
    ids = smollm2.encode(prompt)  # the GGUF says no BOS, so this is what the engine will feed
    assert ids[: len(case["prompt_ids"])] == case["prompt_ids"]


def test_smollm2_special_token_facts(smollm2: Tokenizer) -> None:
    assert smollm2.vocab_size == 49152
    assert (smollm2.bos_token_id, smollm2.eos_token_id, smollm2.pad_token_id) == (1, 2, 2)
    assert smollm2.add_bos_token is False
    # <|im_end|> is the eos; llama.cpp also stops on <|endoftext|> (its end-of-generation list)
    assert smollm2.eos_token_ids == {0, 2}
    assert smollm2.id_to_token(1) == "<|im_start|>"
    assert smollm2.id_to_token(10**6) is None
    ids = smollm2.encode("<|im_start|>user\nhi<|im_end|>")
    assert smollm2.decode(ids) == "user\nhi"  # control tokens dropped by default


def test_smollm2_digit_split_follows_its_own_tokenizer_json(smollm2: Tokenizer) -> None:
    """Beyond llama.cpp's 32 strings: SmolLM2's tokenizer.json isolates every digit
    (Digits(individual_digits) then the GPT-2 regex). Spaces before digits and non-ASCII numerals
    are where a plain GPT-2 regex - what transformers' GGUF loader uses for "smollm" - goes wrong."""
    texts = ["  3 apples", "x  42", " ①②③", "a-2 \n३", "½ cup", "v2.0.1  (build 77)"]
    reference = tokenizers.Tokenizer.from_str(smollm2.backend.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    gpt2_only = tokenizers.Tokenizer.from_str(smollm2.backend.to_str())
    gpt2_only.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    ours = [smollm2.encode(t, add_special_tokens=False) for t in texts]
    assert ours == [reference.encode(t).ids for t in texts]
    assert ours != [gpt2_only.encode(t).ids for t in texts]  # the table entry matters
    assert BPE_PRE_TOKENIZERS["smollm"].splits[0] == r"\p{N}"


# ---- Gemma 3 (sentencepiece-style BPE from scores) vs transformers ----------------------------

GEMMA_TEXTS = [
    "Hello, world!",
    "a  b   c",  # runs of spaces are user-defined tokens ("  ", "   ") in Gemma's GGUF
    "  leading and trailing  ",
    "tabs\tand\nnewlines\n\n\n",
    "The year 1999 had 365 days; pi = 3.14159.",
    "naïve café résumé Ünïcödé ß",
    "日本語のテキスト",
    "مرحبا بالعالم",
    "emoji 🚀🔥 test 👍🏽",
    "def add(a, b):\n    return a + b\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<h1>Title</h1> <b>bold</b>",
    "price: $12,345.67 (approx.)",
    "x" * 40,
    "\u00a0nbsp and \u200bzero width, line\r\nwindows",
    "",
]


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    return _load_bundled("gemma3-270m")


@pytest.fixture(scope="module")
def gemma_hf(gemma: Tokenizer) -> Any:  # a transformers GemmaTokenizer
    transformers = pytest.importorskip("transformers")
    path = resolve_model("gemma3-270m").path
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.slow  # transformers takes ~13 s to build its Gemma tokenizer
def test_gemma_matches_transformers(gemma: Tokenizer, gemma_hf: Any) -> None:
    # transformers' Gemma GGUF loader respells the space-run tokens as "▁▁..." and merges them;
    # we keep llama.cpp's reading (they are user-defined tokens matched whole). Both must agree.
    for text in GEMMA_TEXTS:
        ids = gemma.encode(text)
        assert ids == gemma_hf(text)["input_ids"], text
        assert gemma.decode(ids) == gemma_hf.decode(ids, skip_special_tokens=True), text
        assert gemma.decode(gemma.encode(text, parse_special=False)) == text


def test_gemma_special_token_facts(gemma: Tokenizer) -> None:
    assert gemma.vocab_size == 262144
    assert (gemma.bos_token_id, gemma.eos_token_id, gemma.pad_token_id) == (2, 1, 0)
    assert gemma.add_bos_token is True
    assert gemma.eos_token_ids == {1, 106}  # <eos>, and <end_of_turn> which ends every chat turn
    assert gemma.encode("hi", add_special_tokens=False) == gemma.encode("hi")[1:]
    # parse_special=False spells control tokens out; user-defined ones ("\n") stay whole
    assert 105 not in gemma.encode("<start_of_turn>user\n", parse_special=False)
    assert gemma.encode("<start_of_turn>user\n", add_special_tokens=False) == [105, 2364, 107]
    assert gemma.encode("é", add_special_tokens=False) != []  # characters, or byte fallback
    with pytest.raises(ValueError, match="no chat template"):  # this GGUF carries none
        gemma.apply_chat_template([{"role": "user", "content": "hi"}])
