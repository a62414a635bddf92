"""The multi-model configuration, without loading a model or starting a server: keep-alive
durations, `name:tag` splitting, `ModelSpec` validation, the `--config` models file, the native
engine's options and size estimate, `ModelManager.resolve`, and `llmserve serve`'s MODEL arguments.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from llmserve.cli.main import build_parser
from llmserve.cli.serve import model_specs
from llmserve.config import ServerConfig
from llmserve.config.cache import DEFAULT_KV_CACHE_MEMORY
from llmserve.config.engine_args import EngineArgs
from llmserve.config.models import (
    ModelSpec,
    check_specs,
    load_models_file,
    parse_duration,
    spec_from_dict,
    split_tag,
)
from llmserve.model_executor.model_loader.source import DEFAULT_MODEL
from llmserve.server.errors import APIError
from llmserve.server.model_files import engine_args, estimate_size
from llmserve.server.models import ModelManager

MISSING = "/nonexistent-llmserve-test"
"""A folder that does not exist: sources under it resolve to no files, so nothing is read."""


def raises(match: str):
    """pytest.raises(ValueError) whose message contains `match` literally."""
    return pytest.raises(ValueError, match=re.escape(match))


# -- parse_duration ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (300, 300.0),
        (2.5, 2.5),
        (0, 0.0),
        ("0", 0.0),
        ("300", 300.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("300ms", 0.3),
        ("1.5h", 5400.0),
        ("10s", 10.0),
        ("1h1m1s", 3661.0),
        (" 5m ", 300.0),
        ("+5m", 300.0),
    ],
)
def test_parse_duration_reads_numbers_and_go_durations(value, seconds):
    assert parse_duration(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", [-1, -5, -0.5, "-1", "-5m", -math.inf])
def test_parse_duration_negative_means_forever(value):
    assert parse_duration(value) == math.inf


def test_parse_duration_none_stays_none():
    assert parse_duration(None) is None


@pytest.mark.parametrize(
    "value", ["soon", "5x", "", "m5", "1h30", "5 m", "-", "nan", True, False, "--5", "+-5", [5], {"a": 1}]
)
def test_parse_duration_rejects_what_it_cannot_read(value):
    with raises(repr(value)):
        parse_duration(value)


# -- split_tag --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("smollm2:135m", ("smollm2", "135m")),
        ("qwen3:8b-instruct", ("qwen3", "8b-instruct")),
        ("x", ("x", None)),
        ("x:", ("x:", None)),
        (":y", (":y", None)),
        # only the last path component may carry a tag
        ("C:/models/x.gguf", ("C:/models/x.gguf", None)),
        ("hf.co/org/model", ("hf.co/org/model", None)),
        ("http://gpu-box:8000/v1", ("http://gpu-box:8000/v1", None)),
        ("/a/b:c", ("/a/b", "c")),
        ("hf.co/org/model:Q4_K_M", ("hf.co/org/model", "Q4_K_M")),
        ("registry:5000/library/x:latest", ("registry:5000/library/x", "latest")),
        ("http://host:8000", ("http://host:8000", None)),  # a URL's port is not a tag
        ("C:\\models\\x.gguf", ("C:\\models\\x.gguf", None)),  # nor a Windows drive
        ("C:\\models\\x:q4", ("C:\\models\\x", "q4")),
    ],
)
def test_split_tag(name, expected):
    assert split_tag(name) == expected


def test_spec_base_tag_and_names():
    spec = ModelSpec("smollm2:135m", aliases=("small", "tiny"))
    assert (spec.base, spec.tag) == ("smollm2", "135m")
    assert spec.names == ("smollm2:135m", "small", "tiny")
    assert (ModelSpec("plain").base, ModelSpec("plain").tag) == ("plain", None)


# -- ModelSpec --------------------------------------------------------------------------------------


def test_model_spec_defaults():
    spec = ModelSpec("m")
    assert (spec.source, spec.engine, spec.aliases, spec.preload) == (None, "native", (), False)
    assert (spec.keep_alive, spec.default, spec.options) == (None, False, {})


@pytest.mark.parametrize("name", ["", " m", "m ", "\tm"])
def test_model_spec_rejects_bad_names(name):
    with raises(f"got {name!r}"):
        ModelSpec(name)


def test_model_spec_rejects_an_unknown_engine():
    with raises("engine must be one of native, transformers, openai; got 'vllm'"):
        ModelSpec("m", engine="vllm")


@pytest.mark.parametrize("source", [None, "", "gpu-box:8000/v1", "ftp://gpu-box/v1", "/models/x"])
def test_openai_engine_needs_an_http_source(source):
    with raises(f"the openai engine needs source: the upstream's URL (http://host:port/v1); got {source!r}"):
        ModelSpec("m", engine="openai", source=source)


def test_openai_engine_accepts_http_and_https_and_its_options():
    options = {"model": "Qwen/Qwen3-8B", "api_key_env": "KEY", "api_key": "k", "timeout": 5}
    assert ModelSpec("m", engine="openai", source="http://h:8000/v1", options=options).options == options
    assert ModelSpec("m", engine="openai", source="https://h/v1").source == "https://h/v1"


def test_openai_engine_rejects_unknown_options():
    with raises("unknown openai engine option(s) ['kv_cache_memory', 'zzz']"):
        ModelSpec("m", engine="openai", source="http://h/v1", options={"zzz": 1, "kv_cache_memory": 1})


def test_model_spec_rejects_a_negative_keep_alive():
    with raises("keep_alive must be >= 0 seconds (inf: never); got -1"):
        ModelSpec("m", keep_alive=-1)
    assert ModelSpec("m", keep_alive=0).keep_alive == 0
    assert ModelSpec("m", keep_alive=math.inf).keep_alive == math.inf


# -- spec_from_dict and the models file -------------------------------------------------------------


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return path


VALID_FILE = """\
models:
  - name: smollm2:135m-instruct
    source: smollm2-135m-instruct
    aliases: [default-chat, chat]
    preload: true
    keep_alive: 10m
    default: true
    options: {kv_cache_memory: 256MiB, max_num_seqs: 16}
  - name: smollm2:360m
    source: /models/smollm2-360m
    keep_alive: -1
  - name: qwen3:8b
    engine: openai
    source: http://gpu-box:8000/v1
    aliases: qwen
    options: {model: Qwen/Qwen3-8B, api_key_env: GPU_BOX_KEY}
"""


def test_load_models_file(tmp_path):
    first, second, remote = load_models_file(write(tmp_path, VALID_FILE))
    assert first == ModelSpec(
        name="smollm2:135m-instruct",
        source="smollm2-135m-instruct",
        aliases=("default-chat", "chat"),
        preload=True,
        keep_alive=600.0,
        default=True,
        options={"kv_cache_memory": "256MiB", "max_num_seqs": 16},
    )
    assert second == ModelSpec(name="smollm2:360m", source="/models/smollm2-360m", keep_alive=math.inf)
    assert (remote.engine, remote.source, remote.aliases) == ("openai", "http://gpu-box:8000/v1", ("qwen",))
    assert remote.options == {"model": "Qwen/Qwen3-8B", "api_key_env": "GPU_BOX_KEY"}
    assert (remote.preload, remote.default, remote.keep_alive) == (False, False, None)


def test_load_models_file_accepts_a_str_path(tmp_path):
    assert [s.name for s in load_models_file(str(write(tmp_path, "models: [{name: a}]\n")))] == ["a"]


def test_spec_from_dict_turns_names_and_sources_into_text():
    spec = spec_from_dict({"name": 135, "source": 7, "aliases": [1, "b"]}, "here")
    assert (spec.name, spec.source, spec.aliases) == ("135", "7", ("1", "b"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("models: [a, b\n", "is not valid YAML"),
        (": : :\n  - [\n", "is not valid YAML"),
        ("", "needs a non-empty top-level `models:` list"),
        ("just text\n", "needs a non-empty top-level `models:` list"),
        ("- name: a\n", "needs a non-empty top-level `models:` list"),
        ("model:\n  - name: a\n", "needs a non-empty top-level `models:` list"),
        ("models: {name: a}\n", "needs a non-empty top-level `models:` list"),
        ("models: []\n", "needs a non-empty top-level `models:` list"),
        ("models:\n", "needs a non-empty top-level `models:` list"),
        ("models: [{name: a}]\nport: 80\n", "unknown top-level key(s) ['port']"),
        ("models: [{name: a, sorce: /x}]\n", "models[0]: unknown key(s) ['sorce']"),
        ("models: [{name: a}, {source: /x}]\n", "models[1]: `name` is required"),
        ("models: [a]\n", "each model must be a mapping with at least `name`; got 'a'"),
        ("models: [{name: a, aliases: {b: c}}]\n", "(a): aliases must be a list of names"),
        ("models: [{name: a, aliases: 5}]\n", "(a): aliases must be a list of names; got 5"),
        ("models: [{name: a, aliases: [b, null]}]\n", "(a): aliases must be a list of names"),
        ("models: [{name: }]\n", "models[0]: `name` is required"),
        ("models: [{name: a, keep_alive: 2024-01-01}]\n", "as a duration"),
        ("models: [{name: a, 1: 2, b: 3}]\n", "unknown key(s) ['1', 'b']"),
        ("models: [{name: a, options: [x]}]\n", "(a): options must be a mapping; got ['x']"),
        ("models: [{name: a, options: text}]\n", "(a): options must be a mapping; got 'text'"),
        ("models: [{name: a, preload: 'yes'}]\n", "(a): preload must be true or false; got 'yes'"),
        ("models: [{name: a, preload: 1}]\n", "(a): preload must be true or false; got 1"),
        ("models: [{name: a, default: 'no'}]\n", "(a): default must be true or false; got 'no'"),
        ("models: [{name: a, keep_alive: soon}]\n", "cannot read 'soon' as a duration"),
        (
            "models: [{name: a, engine: vllm}]\n",
            "engine must be one of native, transformers, openai; got 'vllm'",
        ),
        ("models: [{name: a, engine: openai}]\n", "the openai engine needs source"),
        ("models: [{name: ' a'}]\n", "without surrounding spaces; got ' a'"),
        ("models: [{name: a}, {name: a}]\n", "the model name 'a' is used twice ('a' and 'a')"),
        ("models: [{name: a}, {name: b, aliases: [a]}]\n", "the model name 'a' is used twice ('a' and 'b')"),
        ("models: [{name: a, aliases: [x]}, {name: b, aliases: [x]}]\n", "'x' is used twice ('a' and 'b')"),
        (
            "models: [{name: 'a:1', default: true}, {name: 'a:2', default: true}]\n",
            "two default versions of 'a': 'a:1' and 'a:2'",
        ),
    ],
)
def test_load_models_file_errors(tmp_path, text, message):
    path = write(tmp_path, text)
    with raises(message):
        load_models_file(path)


def test_load_models_file_names_the_file_and_entry(tmp_path):
    path = write(tmp_path, "models: [{name: a}, {name: b, bogus: 1}]\n")
    with raises(f"{path}: models[1]: unknown key(s) ['bogus']"):
        load_models_file(path)
    path = write(tmp_path, "models: [{name: a}, {name: b, aliases: 5}]\n")
    with raises(f"{path}: models[1] (b): aliases must be a list of names"):
        load_models_file(path)


def test_load_models_file_that_cannot_be_read(tmp_path):
    with raises("cannot read the models file"):
        load_models_file(tmp_path / "absent.yaml")
    with raises("cannot read the models file"):
        load_models_file(tmp_path)  # a folder


def test_check_specs_allows_defaults_of_different_names():
    check_specs([ModelSpec("a:1", default=True), ModelSpec("a:2"), ModelSpec("b:1", default=True)])


# -- native_options and estimate_size ---------------------------------------------------------------


def test_engine_args_reject_unknown_options():
    spec = ModelSpec("m", options={"bogus": 1, "max_num_seqs": 4})
    with raises("model 'm': unknown engine option(s) ['bogus']"):
        engine_args(spec, {})


def test_engine_args_read_sizes_and_numbers_as_text():
    options = {"kv_cache_memory": "256MiB", "max_num_seqs": "16"}
    args = engine_args(ModelSpec("m", options=options), {"max_num_seqs": 4, "block_size": 32})
    assert (args.kv_cache_memory, args.max_num_seqs, args.block_size) == (268435456, 16, 32)
    assert options["kv_cache_memory"] == "256MiB"  # the spec's own options stay as written
    assert engine_args(ModelSpec("m", options={"kv_cache_memory": 1000}), {}).kv_cache_memory == 1000


def test_engine_args_of_a_transformers_model_ask_for_its_implementation():
    """`engine: transformers` in a models file must reach the engine (it once ran natively with
    its options dropped)."""
    spec = ModelSpec("t", engine="transformers", options={"max_num_seqs": 3})
    args = engine_args(spec, {"max_num_seqs": 8})
    assert (args.model_impl, args.max_num_seqs) == ("transformers", 3)
    assert engine_args(ModelSpec("r", source="http://h:1/v1", engine="openai"), {}) is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_cache_memory": "lots"}, "model 'm': kv_cache_memory: cannot read 'lots' as a size"),
        ({"max_num_seqs": "many"}, "model 'm': max_num_seqs: expected an integer; got 'many'"),
        ({"max_num_seqs": True}, "model 'm': max_num_seqs: expected an integer; got True"),
        ({"enable_prefix_caching": "maybe"}, "model 'm': enable_prefix_caching: expected true or false"),
        ({"dtype": 16}, "model 'm': dtype must be a str; got 16"),
        ({"dtype": "float8"}, "dtype must be one of auto, float32, float16, bfloat16; got 'float8'"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1; got 0"),
        ({"speculative_config": {"method": "magic"}}, "model 'm': speculative_config: speculative method"),
    ],
)
def test_engine_args_name_a_bad_value(options, message):
    with raises(message):
        engine_args(ModelSpec("m", options=options), {})


def model_dir(tmp_path: Path, **config) -> str:
    """A model folder holding only a small config.json (2 layers, 2 KV heads of dimension 16)."""
    base = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps({**base, **config}))
    return str(tmp_path)


FILE_BYTES = 1000
KV_BYTES = 10 * 16 * 2 * 2 * 2 * 16 * 4  # blocks * block_size * (K, V) * layers * kv_heads * head_dim * fp32
BLOCKS = {"num_kv_blocks": 10, "block_size": 16}


def test_estimate_size_from_blocks(tmp_path):
    assert (
        estimate_size(model_dir(tmp_path), FILE_BYTES, EngineArgs.from_options(BLOCKS))
        == FILE_BYTES + KV_BYTES
    )


def test_estimate_size_default_block_size_is_16(tmp_path):
    assert (
        estimate_size(model_dir(tmp_path), FILE_BYTES, EngineArgs.from_options({"num_kv_blocks": 10}))
        == FILE_BYTES + KV_BYTES
    )


def test_estimate_size_counts_a_16_bit_checkpoint_twice(tmp_path):
    source = model_dir(tmp_path, torch_dtype="bfloat16")
    assert estimate_size(source, FILE_BYTES, EngineArgs.from_options(BLOCKS)) == 2 * FILE_BYTES + KV_BYTES
    assert (
        estimate_size(source, FILE_BYTES, EngineArgs.from_options({**BLOCKS, "dtype": "float32"}))
        == 2 * FILE_BYTES + KV_BYTES
    )
    # run in its own 16 bits: the files are the weights
    assert (
        estimate_size(source, FILE_BYTES, EngineArgs.from_options({**BLOCKS, "dtype": "bfloat16"}))
        == FILE_BYTES + KV_BYTES
    )


def test_estimate_size_from_the_kv_budget(tmp_path):
    source = model_dir(tmp_path)
    assert (
        estimate_size(source, FILE_BYTES, EngineArgs.from_options({"kv_cache_memory": 268435456}))
        == FILE_BYTES + 268435456
    )
    assert (
        estimate_size(source, FILE_BYTES, EngineArgs.from_options({})) == FILE_BYTES + DEFAULT_KV_CACHE_MEMORY
    )
    assert (
        estimate_size(None, FILE_BYTES, EngineArgs.from_options({})) == FILE_BYTES + DEFAULT_KV_CACHE_MEMORY
    )


@pytest.mark.parametrize(
    ("kv_dtype", "kv_bytes"),
    [
        ("float16", KV_BYTES // 2),
        ("bfloat16", KV_BYTES // 2),
        ("float16,float32", KV_BYTES * 3 // 4),  # K and V apart: each half at its own width
        ("q8_0,f16", KV_BYTES * (1.125 + 2) // 8),
    ],
)
def test_estimate_size_with_a_16_bit_kv_cache(tmp_path, kv_dtype, kv_bytes):
    options = {**BLOCKS, "kv_cache_dtype": kv_dtype}
    assert (
        estimate_size(model_dir(tmp_path), FILE_BYTES, EngineArgs.from_options(options))
        == FILE_BYTES + kv_bytes
    )


def test_estimate_size_reads_head_dim_and_text_config(tmp_path):
    """A multimodal config keeps the text model's shape under text_config; head_dim wins over
    hidden_size / heads."""
    text = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    config = {"num_hidden_layers": 99, "text_config": {**text, "hidden_size": 4096}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert estimate_size(str(tmp_path), FILE_BYTES, EngineArgs.from_options(BLOCKS)) == FILE_BYTES + KV_BYTES


# -- ModelManager.resolve ---------------------------------------------------------------------------


def spec(name: str, **kwargs) -> ModelSpec:
    return ModelSpec(name, source=f"{MISSING}/{name}", **kwargs)


def manager(*specs: ModelSpec) -> ModelManager:
    return ModelManager(list(specs), ServerConfig())


def resolved(models: ModelManager, name: str | None) -> str:
    return models.resolve(name).name


def not_found(models: ModelManager, name: str) -> APIError:
    with pytest.raises(APIError) as excinfo:
        models.resolve(name)
    assert (excinfo.value.status, excinfo.value.code) == (404, "model_not_found")
    return excinfo.value


def test_manager_construction_loads_nothing():
    models = manager(spec("a", options={"max_num_seqs": 4}), spec("b"))
    assert [slot.state for slot in models.slots] == ["unloaded", "unloaded"]
    assert [slot.file_bytes for slot in models.slots] == [0, 0]
    assert models.slots[0].args.max_num_seqs == 4


def test_manager_merges_engine_options_under_the_specs():
    models = ModelManager(
        [spec("a", options={"max_num_seqs": 4, "kv_cache_memory": "1MiB"}), spec("b")],
        ServerConfig(),
        engine_options={"model": "/cli/model", "max_num_seqs": 64, "dtype": "float32"},
    )
    a, b = (slot.args for slot in models.slots)
    assert (a.max_num_seqs, a.dtype, a.kv_cache_memory, a.model) == (4, "float32", 2**20, f"{MISSING}/a")
    assert (b.max_num_seqs, b.dtype, b.kv_cache_memory, b.model) == (64, "float32", None, f"{MISSING}/b")


def test_manager_refuses_bad_configurations():
    with raises("a server needs at least one model"):
        manager()
    with raises("'a' is used twice"):
        manager(spec("a"), spec("a"))
    with raises("model 'a': unknown engine option(s) ['bogus']"):
        manager(spec("a", options={"bogus": 1}))


def test_resolve_names_and_aliases():
    models = manager(spec("a", aliases=("first",)), spec("b:v1", aliases=("second",)))
    assert resolved(models, None) == "a"
    assert resolved(models, "a") == "a"
    assert resolved(models, "first") == "a"
    assert resolved(models, "b:v1") == "b:v1"
    assert resolved(models, "second") == "b:v1"


def test_resolve_latest_tag_of_an_untagged_name():
    models = manager(spec("a", aliases=("chat",)), spec("b"))
    assert resolved(models, "a:latest") == "a"
    assert resolved(models, "b:latest") == "b"
    assert resolved(models, "chat:latest") == "a"
    not_found(models, "a:v2")


def test_resolve_a_base_name_with_one_version():
    models = manager(spec("x"), spec("smollm2:135m"))
    assert resolved(models, "smollm2") == "smollm2:135m"


def test_resolve_a_base_name_picks_the_default_version():
    models = manager(spec("a:1"), spec("a:latest"), spec("a:2", default=True))
    assert resolved(models, "a") == "a:2"
    assert resolved(models, "a:latest") == "a:latest"


def test_resolve_latest_tag_is_the_default_version():
    """Ollama: `a` and `a:latest` name the same model, the default version."""
    models = manager(spec("a:1", default=True), spec("a:2"))
    assert resolved(models, "a:latest") == "a:1" == resolved(models, "a")


def test_model_spec_rejects_a_nan_keep_alive():
    with raises("keep_alive must be >= 0"):
        ModelSpec("m", keep_alive=float("nan"))


def test_load_models_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_bytes(b"models: [{name: \xff}]\n")
    with raises(f"the models file {path} is not UTF-8 text"):
        load_models_file(path)


def test_resolve_a_base_name_without_default_picks_latest():
    models = manager(spec("a:1"), spec("a:latest"), spec("a:2"))
    assert resolved(models, "a") == "a:latest"


def test_resolve_a_base_name_with_several_versions_and_no_default():
    models = manager(spec("other"), spec("a:1"), spec("a:2"))
    error = not_found(models, "a")
    assert "several versions and none is the default" in error.message
    assert "'a:1', 'a:2'" in error.message
    assert "'other'" not in error.message


def test_resolve_an_unknown_name():
    models = manager(spec("a"), spec("b:1"))
    error = not_found(models, "c")
    assert error.param == "model"
    assert error.message == "the model 'c' was not found; this server serves 'a', 'b:1'"
    not_found(models, "b:2")
    not_found(models, "")


def test_resolve_none_is_the_first_spec():
    assert resolved(manager(spec("z"), spec("a", default=True)), None) == "z"


# -- llmserve serve MODEL ... -----------------------------------------------------------------------


def specs_of(*argv: str) -> list[ModelSpec]:
    return model_specs(build_parser().parse_args(["serve", *argv]))


def summary(specs: list[ModelSpec]) -> list[tuple[str, str | None, bool]]:
    return [(s.name, s.source, s.preload) for s in specs]


def test_serve_without_a_model_serves_the_embedded_one():
    assert DEFAULT_MODEL == "smollm2-135m-instruct"
    assert summary(specs_of()) == [("smollm2-135m-instruct", None, True)]


def test_serve_several_models():
    assert summary(specs_of("a=/x", "b:v1=/y")) == [("a", "/x", True), ("b:v1", "/y", False)]
    assert summary(specs_of("/models/m.gguf")) == [("/models/m.gguf", "/models/m.gguf", True)]


@pytest.mark.parametrize(
    ("preload", "expected"), [("first", [True, False]), ("all", [True, True]), ("none", [False, False])]
)
def test_serve_preload(preload, expected):
    assert [s.preload for s in specs_of("a=/x", "b=/y", "--preload", preload)] == expected


def test_serve_model_flag_counts_as_the_first():
    assert summary(specs_of("--model", "/m", "b=/y")) == [("/m", "/m", True), ("b", "/y", False)]


def test_served_model_name():
    assert summary(specs_of("/x", "--served-model-name", "mine")) == [("mine", "/x", True)]
    assert summary(specs_of("--served-model-name", "mine")) == [("mine", None, True)]
    with raises("--served-model-name names one model"):
        specs_of("a=/x", "b=/y", "--served-model-name", "mine")


def test_serve_config(tmp_path):
    path = write(tmp_path, "models: [{name: a, source: /x}, {name: b}]\n")
    assert [s.name for s in specs_of("--config", str(path))] == ["a", "b"]
    with raises("either as MODEL arguments or in --config, not both"):
        specs_of("--config", str(path), "c=/z")
    with raises("either as MODEL arguments or in --config, not both"):
        specs_of("--config", str(path), "--model", "/z")
    with raises("--served-model-name does not apply to --config"):
        specs_of("--config", str(path), "--served-model-name", "mine")


def test_serve_a_path_with_an_equals_sign(tmp_path):
    path = tmp_path / "name=value.gguf"
    path.touch()
    assert summary(specs_of(str(path))) == [(str(path), str(path), True)]


@pytest.mark.parametrize("item", ["=x", "a=", "="])
def test_serve_rejects_half_a_name_source_pair(item):
    with raises(f"cannot read {item!r} as NAME=SOURCE"):
        specs_of(item)


def test_serve_rejects_a_name_used_twice():
    with raises("the model name 'a' is used twice"):
        specs_of("a=/x", "a=/y")
