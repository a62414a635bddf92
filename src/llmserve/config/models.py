"""`ModelSpec`: one model a server can serve (its name, where it comes from, which engine runs it),
and the `--config models.yaml` file that lists several.

    models:
      - name: smollm2:135m-instruct        # Ollama-style name:tag; a request for `smollm2` finds it
        source: smollm2-135m-instruct      # a folder, a .gguf file or a bundled name
        aliases: [default-chat]
        preload: true                      # load at start-up (otherwise on the first request)
        keep_alive: 10m                    # unload after 10 idle minutes (-1: never)
        options: {kv_cache_memory: 256MiB, max_num_seqs: 16}
      - name: qwen3:8b
        engine: openai                     # a remote OpenAI-compatible server, proxied
        source: http://gpu-box:8000/v1
        options: {model: Qwen/Qwen3-8B, api_key_env: GPU_BOX_KEY}

Names follow Ollama: `name:tag`, where a name without a tag means its default version (the spec
marked `default: true`, else the one tagged `latest`, else the only version there is).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENGINES = ("native", "transformers", "openai")

_SPEC_KEYS = {"name", "source", "engine", "aliases", "preload", "keep_alive", "default", "options"}
_DURATION_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|h|m|s)")
_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: str | float | int | None) -> float | None:
    """Ollama's `keep_alive`: seconds as a number, or Go's duration text ("5m", "1h30m", "300ms");
    negative means forever (returned as `math.inf`), 0 means at once. None stays None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"cannot read {value!r} as a duration (examples: 5m, 1h30m, 300, -1)")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip().lower()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text[1:] if text[:1] in ("+", "-") else text  # one sign at most, as Go's
        try:
            if body[:1] in ("+", "-"):
                raise ValueError(body)
            seconds = sign * float(body)
        except ValueError:
            parts = _DURATION_RE.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(
                    f"cannot read {value!r} as a duration (examples: 5m, 1h30m, 300, -1)"
                ) from None
            seconds = sign * sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
    if math.isnan(seconds):
        raise ValueError(f"cannot read {value!r} as a duration (examples: 5m, 1h30m, 300, -1)")
    return math.inf if seconds < 0 else seconds


def split_tag(name: str) -> tuple[str, str | None]:
    """'smollm2:135m' -> ('smollm2', '135m'); a name without a tag -> (name, None).

    Only the last path component may carry the tag, so paths and URLs keep their colons
    ("C:/models/x.gguf", "C:\\models\\x.gguf", "hf.co/org/model" and "http://host:8000" have
    no tag)."""
    if "://" in name:
        return name, None
    cut = max(name.rfind("/"), name.rfind("\\"))
    head, sep, last = (name[:cut], name[cut], name[cut + 1 :]) if cut >= 0 else ("", "", name)
    base, colon, tag = last.partition(":")
    if not colon or not base or not tag:
        return name, None
    return (head + sep + base), tag


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model the server can serve."""

    name: str
    """What clients put in `model` (an Ollama-style `name:tag` or any other string)."""
    source: str | None = None
    """native: a model folder, a .gguf file or a bundled name (None: the embedded default model);
    openai: the upstream's base URL, ending in /v1."""
    engine: str = "native"
    """`native` (llmserve's engine; an architecture it has no implementation of runs on
    transformers' modelling code), `transformers` (that, always: slower) or `openai` (a remote
    OpenAI-compatible server)."""
    aliases: tuple[str, ...] = ()
    """More names for the same model."""
    preload: bool = False
    """Load at start-up rather than on the first request; /health waits for preloaded models."""
    keep_alive: float | None = None
    """Seconds an idle loaded model stays loaded (math.inf: until evicted); None: the server's."""
    default: bool = False
    """The version a request gets when it names this model without a tag."""
    options: dict[str, Any] = field(default_factory=dict)
    """native and transformers: engine options (those of `LLM(...)`: kv_cache_memory, max_num_seqs, ...), over the
    command line's; openai: `model` (the upstream's name), `api_key` or `api_key_env`, `timeout`
    (seconds), `stream_usage` (default true: ask streams for their usage, to count tokens)."""

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip():
            raise ValueError(f"a model name must be non-empty without surrounding spaces; got {self.name!r}")
        if self.engine not in ENGINES:
            raise ValueError(
                f"model {self.name!r}: engine must be one of {', '.join(ENGINES)}; got {self.engine!r}"
            )
        if self.engine == "openai":
            if not self.source or not self.source.startswith(("http://", "https://")):
                raise ValueError(
                    f"model {self.name!r}: the openai engine needs source: the upstream's URL "
                    f"(http://host:port/v1); got {self.source!r}"
                )
            unknown = set(self.options) - {"model", "api_key", "api_key_env", "timeout", "stream_usage"}
            if unknown:
                raise ValueError(f"model {self.name!r}: unknown openai engine option(s) {sorted(unknown)}")
        if self.keep_alive is not None and not self.keep_alive >= 0:  # nan too
            raise ValueError(
                f"model {self.name!r}: keep_alive must be >= 0 seconds (inf: never); got {self.keep_alive}"
            )

    @property
    def base(self) -> str:
        return split_tag(self.name)[0]

    @property
    def tag(self) -> str | None:
        return split_tag(self.name)[1]

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def spec_from_dict(entry: Any, where: str) -> ModelSpec:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: each model must be a mapping with at least `name`; got {entry!r}")
    unknown = sorted(str(k) for k in set(entry) - _SPEC_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(_SPEC_KEYS)}")
    if entry.get("name") is None or entry["name"] == "":
        raise ValueError(f"{where}: `name` is required")
    name = str(entry["name"])
    where = f"{where} ({name})"
    aliases = entry.get("aliases") or []
    if isinstance(aliases, str):
        aliases = [aliases]
    if not isinstance(aliases, list) or any(a is None or a == "" for a in aliases):
        raise ValueError(f"{where}: aliases must be a list of names; got {aliases!r}")
    options = entry.get("options") or {}
    if not isinstance(options, dict):
        raise ValueError(f"{where}: options must be a mapping; got {options!r}")
    engine = entry.get("engine", "native")
    for key in ("preload", "default"):
        if not isinstance(entry.get(key, False), bool):
            raise ValueError(f"{where}: {key} must be true or false; got {entry[key]!r}")
    source = entry.get("source")
    return ModelSpec(
        name=name,
        source=None if source is None else str(source),
        engine=engine,
        aliases=tuple(str(a) for a in aliases),
        preload=entry.get("preload", False),
        keep_alive=parse_duration(entry.get("keep_alive")),
        default=entry.get("default", False),
        options=options,
    )


def load_models_file(path: str | Path) -> list[ModelSpec]:
    """The models of a `--config` YAML file (a top-level `models:` list)."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except UnicodeDecodeError as e:
        raise ValueError(f"the models file {path} is not UTF-8 text: {e}") from None
    except OSError as e:
        raise ValueError(f"cannot read the models file {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"the models file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("models"), list) or not data["models"]:
        raise ValueError(f"the models file {path} needs a non-empty top-level `models:` list")
    unknown = sorted(str(k) for k in set(data) - {"models"})
    if unknown:
        raise ValueError(f"the models file {path}: unknown top-level key(s) {unknown}")
    specs = [spec_from_dict(entry, f"{path}: models[{i}]") for i, entry in enumerate(data["models"])]
    check_specs(specs)
    return specs


def check_specs(specs: list[ModelSpec]) -> None:
    """Every name and alias names one model; at most one default version per name."""
    seen: dict[str, str] = {}
    for spec in specs:
        for name in spec.names:
            if name in seen:
                raise ValueError(f"the model name {name!r} is used twice ({seen[name]!r} and {spec.name!r})")
            seen[name] = spec.name
    defaults: dict[str, str] = {}
    for spec in specs:
        if spec.default:
            if spec.base in defaults:
                raise ValueError(
                    f"two default versions of {spec.base!r}: {defaults[spec.base]!r} and {spec.name!r}"
                )
            defaults[spec.base] = spec.name
