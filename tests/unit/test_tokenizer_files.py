"""The tokenizer room on files made in tmp_path: HF folders (fast and slow tokenizer files, special
tokens, eos ids, chat templates), tiny GGUF vocabularies written with gguf.GGUFWriter, and bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from llmserve.model_executor.model_loader.source import ModelSource
from llmserve.tokenizer import Tokenizer, load_tokenizer
from llmserve.tokenizer.gguf_metadata import read_gguf_metadata

# ---- HF folders ------------------------------------------------------------------------------

BYTE_ALPHABET = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ", "Ċ"]
MERGES = [("Ġ", "h"), ("Ġh", "i"), ("h", "i")]
SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    "{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{% generation %}{{ m['content'] }}{% endgeneration %}<|im_end|>\n"
    "{% endfor %}"
    "{% if tools %}{{ tools | tojson }}\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level_backend(bos_post_processor: bool) -> BackendTokenizer:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + BYTE_ALPHABET + ["Ġh", "Ġhi", "hi"])}
    backend = BackendTokenizer(models.BPE(vocab, MERGES))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    if bos_post_processor:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return backend


def _hf_folder(
    tmp_path: Path,
    config: dict[str, Any],
    generation: dict[str, Any] | None = None,
    bos_post_processor: bool = False,
    files: dict[str, str] | None = None,
) -> Tokenizer:
    folder = tmp_path / "model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    _byte_level_backend(bos_post_processor).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    for name, text in (files or {}).items():
        (folder / name).write_text(text)
    return load_tokenizer(ModelSource("hf", "tiny", folder))


BASE_CONFIG = {
    "bos_token": "<s>",
    "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
    "pad_token": "<pad>",
    "add_bos_token": True,
    "chat_template": CHAT_TEMPLATE,
}


def test_hf_folder_special_tokens_and_eos_ids(tmp_path: Path) -> None:
    tok = _hf_folder(tmp_path, BASE_CONFIG, generation={"eos_token_id": [1, 4]})
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.eos_token_ids == {1, 4}  # </s> and <|im_end|> from generation_config.json
    assert tok.add_bos_token is True
    assert tok.encode(" hi") == [0, tok.backend.token_to_id("Ġhi")]
    assert tok.encode(" hi", add_special_tokens=False) == [tok.backend.token_to_id("Ġhi")]
    assert tok.encode("<|im_start|>hi", add_special_tokens=False)[0] == 3
    spelled = tok.encode("<|im_start|>hi", add_special_tokens=False, parse_special=False)
    assert 3 not in spelled and tok.decode(spelled) == "<|im_start|>hi"
    assert tok.decode([3, tok.backend.token_to_id("hi"), 4]) == "hi"
    assert tok.decode([3, 4], skip_special_tokens=False) == "<|im_start|><|im_end|>"
    assert tok.vocab_size == len(SPECIALS) + len(BYTE_ALPHABET) + 3


@pytest.mark.parametrize(
    ("generation", "expected"), [({"eos_token_id": 4}, {1, 4}), ({}, {1}), ({"eos_token_id": None}, {1})]
)
def test_hf_folder_generation_config_eos_forms(tmp_path: Path, generation: dict, expected: set[int]) -> None:
    assert _hf_folder(tmp_path, BASE_CONFIG, generation=generation).eos_token_ids == expected


@pytest.mark.parametrize(("post_processor", "expected"), [(True, True), (False, False)])
def test_hf_folder_add_bos_follows_post_processor_when_config_is_silent(
    tmp_path: Path, post_processor: bool, expected: bool
) -> None:
    config = {k: v for k, v in BASE_CONFIG.items() if k != "add_bos_token"}
    tok = _hf_folder(tmp_path, config, bos_post_processor=post_processor)
    assert tok.add_bos_token is expected
    assert (tok.encode("hi")[0] == 0) is expected


def test_hf_folder_padding_and_truncation_in_tokenizer_json_are_off(tmp_path: Path) -> None:
    """A tokenizer.json saved with padding and truncation on (all-MiniLM-L6-v2's: 128) must not
    pad one text's ids or cut them: the engine checks lengths itself."""
    folder = tmp_path / "model"
    folder.mkdir()
    backend = _byte_level_backend(bos_post_processor=False)
    backend.enable_padding(pad_id=2, pad_token="<pad>", length=8)
    backend.enable_truncation(max_length=2)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(BASE_CONFIG))
    tok = load_tokenizer(ModelSource("hf", "tiny", folder))
    hi, space_hi = tok.backend.token_to_id("hi"), tok.backend.token_to_id("Ġhi")
    assert tok.encode("hi hi hi", add_special_tokens=False) == [hi, space_hi, space_hi]  # not 2, not 8


def test_hf_folder_bert_post_processor_wraps_in_cls_and_sep(tmp_path: Path) -> None:
    """A BERT tokenizer (no BOS; [CLS]/[SEP] named in the config, added by the post-processor):
    `encode` wraps the text as the post-processor says; without special tokens it does not."""
    folder = tmp_path / "model"
    folder.mkdir()
    backend = _byte_level_backend(bos_post_processor=False)
    backend.post_processor = processors.BertProcessing(("</s>", 1), ("<|im_start|>", 3))
    backend.save(str(folder / "tokenizer.json"))
    config = {"cls_token": "<|im_start|>", "sep_token": "</s>", "pad_token": "<pad>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(ModelSource("hf", "tiny", folder))
    hi = tok.backend.token_to_id("hi")
    assert tok.wraps_cls_sep and not tok.add_bos_token
    assert tok.encode("hi") == [3, hi, 1]
    assert tok.encode("hi", add_special_tokens=False) == [hi]
    assert not _hf_folder(tmp_path / "decoder", BASE_CONFIG).wraps_cls_sep


def test_hf_chat_template_renders_like_hf(tmp_path: Path) -> None:
    tok = _hf_folder(tmp_path, BASE_CONFIG)
    messages = [{"role": "user", "content": "hi"}, {"role": "skip", "content": "x"}]
    assert tok.apply_chat_template(messages) == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("<|im_end|>\n")
    # HF's tojson: no HTML escaping, non-ASCII kept; kwargs reach the template
    tools = [{"name": "f", "description": "<b>é</b>"}]
    rendered = tok.apply_chat_template(messages, tools=tools)
    assert '[{"name": "f", "description": "<b>é</b>"}]' in rendered
    assert tok.apply_chat_template(messages, bos_token="").startswith("<|im_start|>user")


def test_hf_chat_template_errors_are_value_errors(tmp_path: Path) -> None:
    tok = _hf_folder(tmp_path, BASE_CONFIG)
    with pytest.raises(ValueError, match="no tools here"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="list of dicts"):
        tok.apply_chat_template("hi")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.append(1) }}",  # the sandbox is immutable: templates cannot touch our objects
        "{{ ''.__class__.__mro__ }}",  # nor reach Python internals
        "{{ messages[0]['content'] + 1 }}",  # a plain Python TypeError inside the template
    ],
)
def test_hf_chat_template_runtime_failures_are_value_errors(tmp_path: Path, template: str) -> None:
    tok = _hf_folder(tmp_path, {**BASE_CONFIG, "chat_template": template})
    with pytest.raises(ValueError, match="chat template error"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_hf_chat_template_sources(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "PLAIN"}]
    assert _hf_folder(tmp_path / "a", {**BASE_CONFIG, "chat_template": named}).chat_template == "PLAIN"
    jinja = _hf_folder(tmp_path / "b", BASE_CONFIG, files={"chat_template.jinja": "FILE {{ eos_token }}"})
    assert jinja.apply_chat_template([]) == "FILE </s>"  # the separate file wins, as in transformers
    as_json = _hf_folder(tmp_path / "c", BASE_CONFIG, files={"chat_template.json": '{"chat_template": "J"}'})
    assert as_json.chat_template == "J"


def test_hf_folder_without_template_or_with_broken_one(tmp_path: Path) -> None:
    bare = _hf_folder(tmp_path / "a", {k: v for k, v in BASE_CONFIG.items() if k != "chat_template"})
    with pytest.raises(ValueError, match="'tiny' has no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    broken = _hf_folder(tmp_path / "b", {**BASE_CONFIG, "chat_template": "{% for m in messages %}"})
    with pytest.raises(ValueError, match="does not compile"):
        broken.apply_chat_template([])


def test_hf_folder_with_only_slow_files(tmp_path: Path) -> None:
    """vocab.json + merges.txt and no tokenizer.json: transformers converts them, offline."""
    pytest.importorskip("transformers")
    folder = tmp_path / "slow"
    folder.mkdir()
    vocab = {tok: i for i, tok in enumerate(["<|endoftext|>", *BYTE_ALPHABET, "Ġh", "Ġhi", "hi"])}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in MERGES) + "\n")
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(ModelSource("hf", "slow", folder))
    assert tok.encode(" hi hi", add_special_tokens=False) == [vocab["Ġhi"], vocab["Ġhi"]]
    assert tok.eos_token_ids == {0}
    assert tok.decode(tok.encode(" hi hi")) == " hi hi"


def test_hf_folder_without_tokenizer_files(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        load_tokenizer(ModelSource("hf", "empty", tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        load_tokenizer(ModelSource("hf", "broken", tmp_path))


# ---- tiny GGUF vocabularies ------------------------------------------------------------------

# A sentencepiece-style vocabulary (Llama 2 shape): no merges stored, scores decide the order.
SPM_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
SPM_TOKENS += [
    "▁",
    "h",
    "e",
    "l",
    "o",
    "w",
    "r",
    "d",
    "▁h",
    "ll",
    "▁he",
    "▁hell",
    "▁hello",
    "▁w",
    "or",
    "▁wor",
]
SPM_TYPES = [2, 3, 3] + [6] * 256 + [1] * 16


def _write_gguf(path: Path, model: str, **extra: Any) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(extra.pop("tokens", SPM_TOKENS))
    writer.add_token_types(extra.pop("types", SPM_TYPES))
    scores = extra.pop("scores", [0.0] * 259 + [-float(i) for i in range(16)])
    writer.add_token_scores(scores)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for key, value in extra.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _load_gguf(path: Path) -> Tokenizer:
    return load_tokenizer(ModelSource("gguf", path.name, path, (path,)))


def test_gguf_sentencepiece_prefix_space_and_byte_fallback(tmp_path: Path) -> None:
    tok = _load_gguf(
        _write_gguf(tmp_path / "spm.gguf", "llama")
    )  # no add_space_prefix: llama.cpp's default, on
    ids = tok.encode("hello world")
    assert [tok.id_to_token(i) for i in ids] == ["<s>", "▁hello", "▁wor", "l", "d"]
    assert tok.add_bos_token is True  # the default for a sentencepiece vocabulary
    assert tok.decode(ids) == "hello world"  # prefix space stripped again
    fallback = tok.encode("hé", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in fallback] == ["▁h", "<0xC3>", "<0xA9>"]
    assert tok.decode(fallback) == "hé"


@pytest.mark.parametrize(("wo_score", "expected"), [(-1.0, ["wo", "r"]), (-3.0, ["w", "or"])])
def test_gguf_sentencepiece_scores_rank_the_merges(tmp_path: Path, wo_score: float, expected: list) -> None:
    """In "wor" the pairs "wo" and "or" overlap: the higher-scoring token must win, as in llama.cpp."""
    tokens = [*SPM_TOKENS[:259], "w", "o", "r", "wo", "or"]
    scores = [0.0] * 259 + [0.0, 0.0, 0.0, wo_score, -2.0]
    path = _write_gguf(
        tmp_path / "wor.gguf",
        "llama",
        tokens=tokens,
        types=SPM_TYPES[:259] + [1] * 5,
        scores=scores,
        add_space_prefix=False,  # this vocabulary has no "▁"
    )
    tok = _load_gguf(path)
    assert [tok.id_to_token(i) for i in tok.encode("wor", add_special_tokens=False)] == expected


# "1234" with merges 1+2, 3+4, 12+3: each pre-tokenizer cuts the digits differently before BPE runs
# (llama.cpp: GPT-2 keeps digit runs whole, Llama 3 takes up to three, Qwen2 and SmolLM one each).
DIGIT_TOKENS = ["<|endoftext|>", "1", "2", "3", "4", "12", "34", "123"]


@pytest.mark.parametrize(
    ("pre", "expected", "add_bos"),
    [
        ("gpt-2", ["12", "34"], False),
        ("llama-bpe", ["123", "4"], True),  # llama.cpp adds BOS for Llama 3 unless the file says not
        ("qwen2", ["1", "2", "3", "4"], False),
        ("smollm", ["1", "2", "3", "4"], False),
        ("default", ["123", "4"], False),  # its last regex cuts runs of three ASCII digits
    ],
)
def test_gguf_byte_level_pre_tokenizer_table(tmp_path: Path, pre: str, expected: list, add_bos: bool) -> None:
    path = _write_gguf(
        tmp_path / "bpe.gguf",
        "gpt2",
        tokens=DIGIT_TOKENS,
        types=[3] + [1] * 7,
        scores=[0.0] * 8,
        tokenizer_pre=pre,
        token_merges=["1 2", "3 4", "12 3"],
    )
    tok = _load_gguf(path)
    ids = tok.encode("1234", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == expected
    assert tok.add_bos_token is add_bos
    assert tok.decode(ids) == "1234"


def test_gguf_metadata_reader_agrees_with_gguf_package(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "spm.gguf", "llama", chat_template="{{ x }}", add_bos_token=False)
    ours = read_gguf_metadata(path)
    theirs = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}
    assert ours == theirs  # every key, every value (float32 scores decode to the same floats)


def test_gguf_unknown_tokenizer_model_is_refused(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "odd.gguf", "bert-wordpiece")
    with pytest.raises(ValueError, match=r"odd\.gguf.*'bert-wordpiece'"):
        _load_gguf(path)


def test_gguf_unknown_pre_tokenizer_is_refused(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "pre.gguf", "gpt2", tokenizer_pre="no-such-pre", token_merges=[])
    with pytest.raises(ValueError, match=r"pre\.gguf.*'no-such-pre'"):
        _load_gguf(path)


def test_not_a_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF"):
        _load_gguf(path)
    truncated = _write_gguf(tmp_path / "cut.gguf", "llama")
    truncated.write_bytes(truncated.read_bytes()[:200])
    with pytest.raises(ValueError, match="truncated"):
        _load_gguf(truncated)
