"""The GGUF files the servers load: a random Llama folder, converted, then quantized.

    folder     gpu/model.py's `build_model`: transformers' LlamaConfig + save_pretrained, seeded,
               SmolLM2's tokenizer beside it (reused when built with the same spec)
    convert    llama.cpp's own `convert_hf_to_gguf.py` (in the sources build_llama_server.sh
               unpacks; it imports `sentencepiece` even for a BPE vocabulary) to F16, or straight
               to Q8_0 (`--outtype q8_0`, no binary needed: the smoke run's file). Without those
               sources, the smoke run writes its Q8_0 file with the `gguf` package's own writer
               (`write_q8_0_gguf`), labelled so, and CI can run it
    quantize   `llama-quantize F16.gguf OUT.gguf Q4_K_M`

Every file is reused while its source is (a rebuilt folder removes the GGUFs made from it).
Does not know the servers or the table.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from compare import LLAMA_CPP_VERSION
from gpu import model
from gpu.plan import ModelShape
from gpu.runs import run_command, shown
from peers.gguf_to_f32 import peers_dir

CONVERTER = "convert_hf_to_gguf.py"
GGUF_PY_WRITER = "gguf package writer (bench_cpu_scale's own; no llama.cpp sources)"


def llama_cpp_sources() -> Path:
    return peers_dir() / f"llama_cpp_python-{LLAMA_CPP_VERSION}" / "vendor" / "llama.cpp"


def llama_cpp_binary(name: str) -> Path:
    return peers_dir() / f"llama.cpp-{LLAMA_CPP_VERSION}-build" / "bin" / name


def converter_missing() -> str | None:
    """Why llama.cpp's converter cannot run here, or None when it can."""
    if not (llama_cpp_sources() / CONVERTER).is_file():
        return f"no {llama_cpp_sources() / CONVERTER} (benchmarks/peers/build_llama_server.sh unpacks it)"
    if importlib.util.find_spec("sentencepiece") is None:
        return f"{CONVERTER} imports sentencepiece: pip install 'sentencepiece>=0.1.98,<0.3.0'"
    return None


def build_folder(folder: Path, shape: ModelShape, dtype: str) -> dict[str, Any]:
    info = model.build_model(folder, shape, dtype)
    if not info["reused"]:  # new weights: no file converted from the old ones may pass for theirs
        for stale in folder.parent.glob(f"{folder.name}-*.gguf"):
            stale.unlink()
    return info


def convert(folder: Path, out: Path, outtype: str, logs: Path, timeout: float) -> dict[str, Any]:
    """`convert_hf_to_gguf.py FOLDER --outtype f16|q8_0 --outfile OUT` (reused when OUT exists)."""
    cmd = [sys.executable, str(llama_cpp_sources() / CONVERTER), str(folder),
           "--outtype", outtype, "--outfile", str(out)]  # fmt: skip
    return _made(out, cmd, logs / f"convert-{out.stem}.log", timeout, CONVERTER)


def quantize(src: Path, out: Path, ftype: str, logs: Path, timeout: float) -> dict[str, Any]:
    """`llama-quantize SRC OUT TYPE` (reused when OUT exists)."""
    cmd = [str(llama_cpp_binary("llama-quantize")), str(src), str(out), ftype]
    return _made(out, cmd, logs / f"quantize-{out.stem}.log", timeout, "llama-quantize")


def _made(out: Path, cmd: list[str], log: Path, timeout: float, tool: str) -> dict[str, Any]:
    made = {"path": str(out), "tool": tool, "command": shown(cmd)}
    if out.is_file():
        print(f"  {out.name}: reused", flush=True)
        return {**made, "reused": True, **gguf_facts(out)}
    start = time.perf_counter()
    partial = out.with_suffix(".partial")  # a killed run must not leave a file that passes for done
    run_command([partial.as_posix() if part == str(out) else part for part in cmd], log, timeout)
    partial.rename(out)
    return {**made, "reused": False, "seconds": time.perf_counter() - start, **gguf_facts(out)}


def gguf_facts(path: Path) -> dict[str, Any]:
    """The file's size and its tensors' bytes (what a decode step reads: every matrix once, the
    tied embedding as the LM head; the norms' few KiB too), by type."""
    reader = gguf.GGUFReader(path)
    by_type: dict[str, int] = {}
    for t in reader.tensors:
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return {
        "file_bytes": path.stat().st_size,
        "tensor_bytes": sum(by_type.values()),
        "tensor_bytes_by_type": by_type,
        "num_tensors": len(reader.tensors),
    }


# ---------------------------------------------------------------- the smoke run's fallback writer


def write_q8_0_gguf(folder: Path, out: Path, tokenizer_gguf: Path) -> dict[str, Any]:
    """A Q8_0 GGUF of the folder's Llama as convert_hf_to_gguf.py writes one, for machines without
    llama.cpp's sources (CI): its hyperparameters; the tokenizer's keys copied from `tokenizer_gguf`
    (the embedded SmolLM2, whose vocabulary gpu/model.py wrote beside the weights); the tensors under
    the gguf package's HF -> GGUF names, q/k rows permuted per head as llama.cpp's LlamaModel.permute
    does, matrices in Q8_0 (`gguf.quants.quantize`), norms in F32. Rewritten every time (it is small)."""
    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    n_layer, n_head, n_kv = (
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    # transformers >= 5 keeps rope_theta under rope_parameters
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    head_dim = config["hidden_size"] // n_head
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _copy_tokenizer(gguf.GGUFReader(tokenizer_gguf), writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layer)
    for hf_name, w in load_file(folder / "model.safetensors").items():
        w = w.astype(np.float32)
        if hf_name.endswith("q_proj.weight"):
            w = _permute(w, n_head)
        elif hf_name.endswith("k_proj.weight"):
            w = _permute(w, n_kv)
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        assert name is not None, f"gguf has no name for {hf_name}"
        if w.ndim == 2:
            q8 = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"path": str(out), "tool": GGUF_PY_WRITER, "command": "write_q8_0_gguf (in process)",
            "reused": False, **gguf_facts(out)}  # fmt: skip


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rows (x0..x_{h-1}, y0..y_{h-1}) -> (x0, y0, x1, y1, ...)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)


def tool_versions() -> dict[str, Any]:
    """llama.cpp's provenance: the sdist's version, and the build's as llama-server reports it."""
    server = llama_cpp_binary("llama-server")
    version = None
    if server.is_file():
        out = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=30)
        version = next(
            (ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version")), None
        )
    return {"llama_cpp_python_sdist": LLAMA_CPP_VERSION, "llama_cpp_build": version}
