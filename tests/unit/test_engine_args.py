"""`EngineArgs.from_options`: the one reading of engine options that the command line, `LLM(...)`,
models files and the server's manager share, so a value means the same wherever it is written."""

from __future__ import annotations

import re

import pytest

from llmserve.cli.engine_args import llm_kwargs
from llmserve.cli.main import build_parser
from llmserve.config.engine_args import EngineArgs
from llmserve.config.speculative import SpeculativeConfig
from llmserve.engine.llm import build_engine


def cli_args(*argv: str) -> EngineArgs:
    """What `llmserve generate ARGV` builds its engine from."""
    return EngineArgs.from_options(llm_kwargs(build_parser().parse_args(["generate", *argv, "x"])), "cli")


@pytest.mark.parametrize(
    ("argv", "options"),
    [
        (["--kv-cache-memory", "4GiB"], {"kv_cache_memory": "4GiB"}),
        (["--kv-cache-memory", "512MiB"], {"kv_cache_memory": 512 * 2**20}),
        (["--max-num-seqs", "16"], {"max_num_seqs": "16"}),
        (["--max-model-len", "2048"], {"max_model_len": 2048.0}),
        (["--no-prefix-caching"], {"enable_prefix_caching": "false"}),
        (["--cpu-activations", "int8"], {"cpu_activations": "int8"}),
        (["--stream-interval", "8"], {"stream_interval": "8"}),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
        ),
        (
            ["--hf-overrides", '{"classifier_from_token": ["no", "yes"], "architectures": ["X"]}'],
            {"hf_overrides": {"architectures": ["X"], "classifier_from_token": ["no", "yes"]}},
        ),
    ],
)
def test_python_values_mean_what_the_command_line_means(argv: list[str], options: dict) -> None:
    assert EngineArgs.from_options(options) == cli_args(*argv)


def test_defaults_are_the_command_lines() -> None:
    """`LLM()` and `llmserve generate` with no flags build the same engine."""
    assert EngineArgs() == cli_args().replace(show_progress=True)
    assert EngineArgs().cpu_activations == "auto"


def test_speculative_config_from_json_text() -> None:
    args = EngineArgs.from_options({"speculative_config": '{"method": "ngram"}'})
    assert args.speculative_config == SpeculativeConfig(method="ngram")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_cache_memory": "4 lots"}, "LLM: kv_cache_memory: cannot read '4 lots' as a size in bytes"),
        ({"kv_cache_memory": -5}, "kv_cache_memory must be > 0 bytes; got -5"),
        ({"max_num_seqs": 2.5}, "LLM: max_num_seqs: expected an integer; got 2.5"),
        ({"block_size": None}, "LLM: block_size cannot be null"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype must be 'auto' or one of"),
        ({"cpu_activations": "int4"}, "cpu_activations must be one of auto, int16, int8; got 'int4'"),
        ({"max_num_seq": 4}, "LLM: unknown engine option(s) ['max_num_seq']"),
        ({"stream_interval": 0}, "stream_interval must be >= 1; got 0"),
        ({"hf_overrides": "[1]"}, "hf_overrides must be a JSON object; got '[1]'"),
    ],
)
def test_llm_names_a_bad_option_before_loading(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        build_engine(**options)


@pytest.mark.parametrize(
    "modules",
    ["sql=/a/sql,chat=/b/chat", ["sql=/a/sql", "chat=/b/chat"], {"sql": "/a/sql", "chat": "/b/chat"}],
)
def test_models_file_names_lora_adapters_as_text_list_or_mapping(modules):
    args = EngineArgs.from_options({"model": "m", "enable_lora": True, "lora_modules": modules}, "model 'm'")
    assert args.lora_config().modules == (("sql", "/a/sql"), ("chat", "/b/chat"))


def test_bad_lora_modules_name_the_model():
    with pytest.raises(ValueError, match=r"model 'm': lora_modules: expected name=path"):
        EngineArgs.from_options({"model": "m", "enable_lora": True, "lora_modules": ["sql"]}, "model 'm'")


def test_lora_dtype_reaches_the_lora_config_and_a_bad_one_is_named():
    assert cli_args("--enable-lora", "--lora-dtype", "bfloat16").lora_config().lora_dtype == "bfloat16"
    assert cli_args("--enable-lora").lora_config().lora_dtype == "auto"  # default: the model's dtype
    options = {"model": "m", "enable_lora": True, "lora_dtype": "float16"}
    assert EngineArgs.from_options(options, "model 'm'").lora_config().lora_dtype == "float16"
    with pytest.raises(ValueError, match=r"lora_dtype must be one of .*got 'int8'"):
        EngineArgs.from_options({**options, "lora_dtype": "int8"}, "model 'm'")
    with pytest.raises(SystemExit):
        cli_args("--enable-lora", "--lora-dtype", "int8")


def test_cli_lora_modules_take_vllms_json_entries():
    args = cli_args(
        "--lora-modules",
        "sql=/a/sql",
        '{"name": "chat", "path": "/b/chat", "base_model_name": "m"}',
        "--enable-lora",
    )
    assert args.lora_config().modules == (("sql", "/a/sql"), ("chat", "/b/chat"))
    with pytest.raises(ValueError, match=r"lora_modules: not valid JSON"):
        cli_args("--lora-modules", '{"name": "chat",', "--enable-lora")
    with pytest.raises(ValueError, match=r'lora_modules: expected \{"name"'):
        cli_args("--lora-modules", '{"name": "chat", "path": "/p", "rank": 4}', "--enable-lora")


def test_a_servers_cli_adapters_go_to_the_model_they_name():
    from llmserve.config.models import ModelSpec
    from llmserve.server.model_files import engine_args

    base = {
        "enable_lora": True,
        "lora_modules": ["any=/p/any", '{"name": "sql", "path": "/p/sql", "base_model_name": "a"}'],
    }
    mods = {
        name: engine_args(ModelSpec(name=name, source=f"/m/{name}"), base).lora_config().modules
        for name in ("a", "b")
    }
    assert mods == {"a": (("any", "/p/any"), ("sql", "/p/sql")), "b": (("any", "/p/any"),)}


def test_a_cli_adapter_naming_no_served_model_is_refused():
    from llmserve.config import ServerConfig
    from llmserve.config.models import ModelSpec
    from llmserve.server.models import ModelManager

    base = {"enable_lora": True, "lora_modules": ['{"name": "sql", "path": "/p", "base_model_name": "zzz"}']}
    with pytest.raises(ValueError, match=r"'sql' names base_model_name 'zzz', which is no served model"):
        ModelManager([ModelSpec(name="a", source="/m/a")], ServerConfig(), base)
