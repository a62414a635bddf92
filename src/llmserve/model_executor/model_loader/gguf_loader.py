"""GGUF checkpoints (llama.cpp's format, one file or a `gguf-split` set) read as HF checkpoints.

Owns: opening the parts (memory-mapped), reading metadata, building a transformers config from it,
mapping GGUF tensor names to HF checkpoint names, dequantizing, and undoing what llama.cpp's
converter changed so each tensor equals the HF original:

    llama   attn_q / attn_k rows permuted for ggml's interleaved RoPE  -> un-permute
    gemma3  every RMSNorm weight stored as (w + 1)                     -> subtract 1
    gpt2    Conv1D weights stored transposed ([out, in])               -> transpose back to [in, out]
    bert    (an encoder: all-MiniLM, BGE, mxbai-embed-large) nothing changed; the pooler dropped
    clip    (Qwen2-VL's, Qwen2.5-VL's projectors) one HF tensor written as several:
            the fused qkv as attn_q, attn_k, attn_v                    -> concatenated again
            the Conv3d patch kernel [C, 3, T, P, P] as T 2-D kernels   -> stacked on axis 2
            (`v.patch_embd.weight`, `v.patch_embd.weight.1`)

The per-architecture name tables and fixes are gguf_names.py's; the vision projector's (architecture
`clip`, by `clip.projector_type`) gguf_clip.py's.

Does not know models, devices or tokenizers (the GGUF vocabulary is the tokenizer's business).
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderTensor
from gguf.quants import dequantize

from llmserve.layers.quantization.formats import QuantizedRows
from llmserve.model_executor.model_loader import gguf_clip, gguf_config, gguf_names
from llmserve.model_executor.model_loader.errors import (
    ModelLoadError,
    ModelNotFoundError,
    UnexpectedWeightError,
    UnsupportedArchitectureError,
    UnsupportedTensorTypeError,
)
from llmserve.model_executor.model_loader.gguf_clip import Fix, Join
from llmserve.model_executor.model_loader.gguf_quant import EXACT_TYPES, read_rows

_Q = GGMLQuantizationType
SUPPORTED_TENSOR_TYPES: tuple[GGMLQuantizationType, ...] = (
    _Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K,
    _Q.Q2_K, _Q.Q3_K, _Q.IQ4_NL, _Q.IQ4_XS, _Q.MXFP4,
)  # fmt: skip
# llama.cpp-only tensors with no HF counterpart (rope_freqs and Phi-3's rope_factors_* are folded
# into the config instead).
_NON_HF_TENSORS = (
    "rope_freqs", "rope_factors_long", "rope_factors_short", "blk.{bid}.attn_rot_embd",
    "dense_2", "dense_3",  # EmbeddingGemma's Dense layers: read apart (st_dense.gguf_dense_stack)
)  # fmt: skip
_BLOCK_RE = re.compile(r"^(v\.)?blk\.(\d+)\.(.+)$")  # a vision projector's blocks are `v.blk.N.*`


class _FastReader(GGUFReader):
    """GGUFReader that parses metadata arrays in bulk.

    The stock reader makes two memmap views per array element, so a 262k-token vocabulary costs
    about 10 s (Gemma 3 270M, 2-core CPU) just to open the file. This builds the same fields (same
    parts, data indices and types) in one pass; byte-swapped files and nested arrays take the stock path.
    """

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        itype, n, offs = GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
        types = [GGUFValueType.ARRAY, itype] if n else [GGUFValueType.ARRAY]
        raw = self.data.view(np.ndarray)  # plain views are ~10x cheaper to make than memmap views
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            values = raw[offs : offs + n * np.dtype(nptype).itemsize].view(nptype)
            return 12 + values.nbytes, [raw_itype, alen, *values.reshape(n, 1)], list(range(2, 2 + n)), types
        if itype != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        if offs + 8 * n > len(raw):  # a corrupt length would otherwise loop for a very long time
            raise ValueError(f"metadata array of {n} strings runs past the end of the file")
        parts: list[Any] = [raw_itype, alen]
        buf = memoryview(raw)
        for _ in range(n):  # each string: uint64 length, then its bytes
            slen = int.from_bytes(buf[offs : offs + 8], sys.byteorder)
            parts += (raw[offs : offs + 8].view(np.uint64), raw[offs + 8 : offs + 8 + slen])
            offs += 8 + slen
        return offs - orig_offs, parts, list(range(3, 3 + 2 * n, 2)), types


def _drop_mapped_pages(reader: GGUFReader, t: ReaderTensor) -> None:
    """Once the model copied `t` out of the file's memory map, let this process drop the pages it
    touched (they stay in the page cache, and are read again if anything touches them): without
    this a load's peak resident memory was the copies plus the whole file (0.4-0.6 GiB above
    serving for a 1B model, docs/benchmarks.md), not the copies plus one tensor."""
    mm = getattr(reader.data, "_mmap", None)
    if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = int(t.data_offset) - int(t.data_offset) % mmap.PAGESIZE
    with contextlib.suppress(OSError, ValueError):
        mm.madvise(mmap.MADV_DONTNEED, start, int(t.data_offset) + int(t.n_bytes) - start)


def _open(path: Path) -> GGUFReader:
    try:
        return _FastReader(path)
    except FileNotFoundError:
        raise ModelNotFoundError(f"{path}: no such GGUF file") from None
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def row_order(fix: Fix, num_rows: int, metadata: Any) -> torch.Tensor | None:
    """The rows' new order when `fix` only reorders rows (llama's q/k), else None: a fix that
    turns a column of row numbers into a permutation of them is a row reordering. `metadata`:
    what the fix reads (a checkpoint, or anything with its `require` / `arch_field`)."""
    index = fix(torch.arange(num_rows, dtype=torch.float32).unsqueeze(1), metadata)
    if tuple(index.shape) != (num_rows, 1) or not torch.equal(
        index[:, 0].sort().values, torch.arange(num_rows).float()
    ):
        return None
    return index[:, 0].long()


@dataclass(frozen=True, slots=True)
class _ArchSpec:
    """How one GGUF `general.architecture` maps onto its HF counterpart."""

    hf_architecture: str
    names: dict[str, str]  # GGUF base name -> HF base name (".weight" / ".bias" are appended)
    fixes: dict[str, Fix]  # GGUF base name -> what undoes llama.cpp's conversion of it
    build_config: Callable[[GGUFCheckpoint], transformers.PretrainedConfig]
    joins: dict[str, Join] = dataclasses.field(default_factory=dict)
    """GGUF tensor name (its first part) -> the parts that go back into one HF tensor."""


_ARCHS: dict[str, _ArchSpec] = {
    "llama": _ArchSpec(
        "LlamaForCausalLM", gguf_names.LLAMA_NAMES, gguf_names.LLAMA_FIXES, gguf_config.llama_config
    ),
    "qwen2": _ArchSpec("Qwen2ForCausalLM", gguf_names.LLAMA_NAMES, {}, gguf_config.qwen2_config),
    "qwen3": _ArchSpec(
        "Qwen3ForCausalLM", gguf_names.QWEN3_NAMES, gguf_names.QWEN3_FIXES, gguf_config.qwen3_config
    ),
    "qwen2moe": _ArchSpec(
        "Qwen2MoeForCausalLM",
        gguf_names.QWEN2MOE_NAMES,
        gguf_names.QWEN2MOE_FIXES,
        gguf_config.qwen2moe_config,
    ),
    "qwen3moe": _ArchSpec("Qwen3MoeForCausalLM", gguf_names.QWEN3MOE_NAMES, {}, gguf_config.qwen3moe_config),
    # Qwen2-VL's and Qwen2.5-VL's language model (M-RoPE): alone, text positions are equal on the
    # three axes, which is plain RoPE; with a projector (gguf_mmproj.py) the VL model
    "qwen2vl": _ArchSpec("Qwen2ForCausalLM", gguf_names.LLAMA_NAMES, {}, gguf_config.qwen2_config),
    "gemma3": _ArchSpec(
        "Gemma3ForCausalLM", gguf_names.GEMMA3_NAMES, gguf_names.GEMMA3_FIXES, gguf_config.gemma3_config
    ),
    "gemma-embedding": _ArchSpec(
        "Gemma3TextModel",
        gguf_names.GEMMA3_NAMES,
        gguf_names.GEMMA3_FIXES,
        gguf_config.gemma_embedding_config,
    ),
    "phi3": _ArchSpec("Phi3ForCausalLM", gguf_names.PHI3_NAMES, {}, gguf_config.phi3_config),
    "smollm3": _ArchSpec(
        "SmolLM3ForCausalLM", gguf_names.LLAMA_NAMES, gguf_names.LLAMA_FIXES, gguf_config.smollm3_config
    ),
    "granite": _ArchSpec(
        "GraniteForCausalLM", gguf_names.LLAMA_NAMES, gguf_names.LLAMA_FIXES, gguf_config.granite_config
    ),
    "granitemoe": _ArchSpec(
        "GraniteMoeForCausalLM",
        gguf_names.GRANITEMOE_NAMES,
        gguf_names.LLAMA_FIXES,
        gguf_config.granite_config,
    ),
    "starcoder2": _ArchSpec(
        "Starcoder2ForCausalLM", gguf_names.STARCODER2_NAMES, {}, gguf_config.starcoder2_config
    ),
    "olmo2": _ArchSpec("Olmo2ForCausalLM", gguf_names.OLMO2_NAMES, {}, gguf_config.olmo2_config),
    "exaone4": _ArchSpec("Exaone4ForCausalLM", gguf_names.OLMO2_NAMES, {}, gguf_config.exaone4_config),
    "gemma2": _ArchSpec(
        "Gemma2ForCausalLM", gguf_names.GEMMA2_NAMES, gguf_names.GEMMA3_FIXES, gguf_config.gemma2_config
    ),
    "gpt2": _ArchSpec(
        "GPT2LMHeadModel", gguf_names.GPT2_NAMES, gguf_names.GPT2_FIXES, gguf_config.gpt2_config
    ),
    "gpt-oss": _ArchSpec("GptOssForCausalLM", gguf_names.GPT_OSS_NAMES, {}, gguf_config.gpt_oss_config),
    "bert": _ArchSpec("BertModel", gguf_names.BERT_NAMES, {}, gguf_config.bert_config),
    "nomic-bert": _ArchSpec("NomicBertModel", gguf_names.NOMIC_BERT_NAMES, {}, gguf_config.nomic_bert_config),
    "modern-bert": _ArchSpec(
        "ModernBertModel", gguf_names.MODERN_BERT_NAMES, {}, gguf_config.modern_bert_config
    ),
}


# A vision projector: its config is the vision tower's; the model's comes from both files.
_CLIP_ARCHS = {
    kind: _ArchSpec(p.hf_architecture, p.names, p.fixes, gguf_config.clip_vision_config, p.joins)
    for kind, p in gguf_clip.PROJECTORS.items()
}


@dataclass(frozen=True, slots=True)
class _Planned:
    """One HF tensor to yield: from GGUF tensor `name` (or its slice `expert` of a stacked
    experts tensor), with `fix` undoing llama.cpp's conversion."""

    name: str
    hf_name: str
    fix: Fix | None
    expert: int | None = None
    last_of_tensor: bool = True
    """The last slice read from `name`: its mapped pages can go."""
    join: Join | None = None
    """One HF tensor written as several (`name` the first): the parts' GGUF names and how."""
    parts: tuple[str, ...] = ()


def _f32(v: float) -> float:
    return float(str(np.float32(v)))


def _table_key(base: str) -> tuple[str, str | None]:
    """Table key and block index: blk.3.attn_q -> ("blk.{bid}.attn_q", "3"); token_embd -> (.., None)."""
    m = _BLOCK_RE.match(base)
    return (f"{m.group(1) or ''}blk.{{bid}}.{m.group(3)}", m.group(2)) if m else (base, None)


# -- the checkpoint ---------------------------------------------------------------------------------


class GGUFCheckpoint:
    """All parts of one GGUF model: metadata from the first part, tensors from every part."""

    def __init__(self, parts: Sequence[Path]) -> None:
        if not parts:
            raise ModelNotFoundError("no GGUF files were given")
        self.parts = [Path(p) for p in parts]
        self._readers = [_open(p) for p in self.parts]
        self._file = str(self.parts[0])
        arch = self.field("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"{self._file}: GGUF metadata has no general.architecture")
        self.architecture: str = arch
        self._check_split()
        # GGUF name -> (file, tensor); names must be unique across parts.
        self._tensors: dict[str, tuple[str, ReaderTensor]] = {}
        for path, reader in zip(self.parts, self._readers, strict=True):
            for t in reader.tensors:
                if t.name in self._tensors:
                    raise ModelLoadError(f"{path}: tensor {t.name!r} is also in {self._tensors[t.name][0]}")
                self._tensors[t.name] = (str(path), t)
        expected, n = self.field("split.tensors.count"), len(self._tensors)
        if expected is not None and expected != n:
            raise ModelLoadError(f"{self._file}: split GGUF declares {expected} tensors, holds {n}")

    def _check_split(self) -> None:
        """A gguf-split set must be given whole and in order (each part stores its `split.no`)."""
        count = self.field("split.count")
        if count is not None and count != len(self.parts):
            raise ModelLoadError(f"{self._file}: split GGUF has {count} parts, {len(self.parts)} given")
        for i, reader in enumerate(self._readers):
            no = reader.fields.get("split.no")
            if no is not None and no.contents() != i:
                raise ModelLoadError(f"{self.parts[i]}: is split part {no.contents() + 1}, given as {i + 1}")

    # -- metadata ---------------------------------------------------------------------------------

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value (str, int, float, bool or list) from the first part, or `default`."""
        f = self._readers[0].fields.get(key)
        if f is None or not f.types:
            return default
        value = f.contents()
        if f.types[-1] is GGUFValueType.FLOAT32:  # shortest float32 decimal: 1e-05, not 9.99999974e-06
            return [_f32(v) for v in value] if isinstance(value, list) else _f32(value)
        return value

    def arch_field(self, key: str, default: Any = None) -> Any:
        """`field("<architecture>.<key>")`: the per-architecture hyperparameters."""
        return self.field(f"{self.architecture}.{key}", default)

    def require(self, key: str) -> Any:
        """`arch_field(key)` that llama.cpp also requires: missing is an error, not a default."""
        value = self.arch_field(key)
        if value is None:
            raise ModelLoadError(f"{self._file}: GGUF metadata lacks {self.architecture}.{key}")
        return value

    def hf_base_name(self, gguf_base: str) -> tuple[str, Fix | None] | None:
        """(HF name, the fix that undoes llama.cpp's conversion) of a GGUF tensor's base name,
        e.g. blk.3.attn_q -> model.layers.3.self_attn.q_proj; None when this architecture has no
        such tensor (or only a stacked experts one). For LoRA adapters (lora/gguf_adapter.py)."""
        key, bid = _table_key(gguf_base)
        hf_base = self._spec.names.get(key)
        if hf_base is None or "{xid}" in hf_base:
            return None
        return hf_base.format(bid=bid), self._spec.fixes.get(key)

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, gguf_name: str) -> bool:
        return gguf_name in self._tensors

    def tensor_shape(self, gguf_name: str) -> tuple[int, ...]:
        """A tensor's logical shape in torch's order (GGUF stores it innermost first)."""
        if gguf_name not in self._tensors:
            raise ModelLoadError(f"{self._file}: GGUF file lacks tensor {gguf_name!r}")
        return tuple(int(n) for n in reversed(self._tensors[gguf_name][1].shape.tolist()))

    def tensor_data(self, gguf_name: str) -> np.ndarray:
        """One tensor dequantized to float32 in its GGUF layout (no name mapping, no fixes)."""
        t = self._tensors[gguf_name][1]
        return np.asarray(dequantize(t.data, t.tensor_type))

    def vocab_size(self) -> int:
        """The explicit key, else the embedding's rows (what the weights need), else the token list."""
        if (n := self.arch_field("vocab_size")) is not None:
            return int(n)
        if "token_embd.weight" in self._tensors:
            return int(self._tensors["token_embd.weight"][1].shape[-1])  # ggml order: [hidden, vocab]
        tokens = self._readers[0].fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ModelLoadError(f"{self._file}: vocabulary size unknown (no vocab_size, token_embd, tokens)")
        return len(tokens.data)

    @property
    def _spec(self) -> _ArchSpec:
        if self.architecture == "clip":
            return _CLIP_ARCHS[gguf_clip.projector_type(self)]
        spec = _ARCHS.get(self.architecture)
        if spec is None:
            raise UnsupportedArchitectureError(
                f"{self._file}: GGUF architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(sorted(_ARCHS))}"
            )
        return spec

    @property
    def hf_architecture(self) -> str:
        """The HF `architectures` name this GGUF loads as (e.g. "LlamaForCausalLM")."""
        if self.architecture == "llama" and self.arch_field("expert_count"):
            return "MixtralForCausalLM"
        return self._spec.hf_architecture

    def hf_config(self) -> transformers.PretrainedConfig:
        """A transformers config for this model, with `.architectures` set to the HF class name."""
        spec = self._spec
        try:
            config = spec.build_config(self)
            # an embedding model's file (llama.cpp writes `{arch}.pooling_type` from its
            # sentence-transformers config: Qwen3-Embedding's last token): the engine's default pooling
            pooling = gguf_config.GGUF_POOLING.get(self.arch_field("pooling_type"))
            if pooling is not None:
                config.gguf_pooling = pooling
            return config
        except ModelLoadError:
            raise
        except Exception as exc:  # transformers validates configs with several exception types
            raise ModelLoadError(
                f"{self._file}: GGUF metadata does not make a valid {spec.hf_architecture} config ({exc})"
            ) from exc

    # -- tensors ----------------------------------------------------------------------------------

    def tensor_types(self) -> list[str]:
        """The storage types of the tensors, most common first (e.g. ["Q4_1", "F32", "Q8_0"])."""
        counts = Counter(t.tensor_type.name for _, t in self._tensors.values())
        return [name for name, _ in counts.most_common()]

    def num_tensors(self) -> int:
        """How many tensors `iter_weights` yields (a stacked experts tensor counts once per expert)."""
        return len(self._plan())

    def hf_tensor_types(self) -> dict[str, str]:
        """HF checkpoint name -> the GGUF type its tensor has on disk (e.g. "Q4_1")."""
        return {p.hf_name: self._tensors[p.name][1].tensor_type.name for p in self._plan()}

    def iter_weights(
        self, dtype: torch.dtype, keep_quantized: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedRows, str]]:
        """(HF name, tensor in the HF checkpoint's shape and values as `dtype` on CPU, file) per tensor.

        With `keep_quantized`, a tensor whose HF name it accepts and whose GGUF type maps onto a
        block format (gguf_quant.EXACT_TYPES) comes as `QuantizedRows` instead, read without a
        float round trip (llama.cpp's q/k row order is undone on the rows). Every tensor's type and
        name is checked here, before the first one is read."""
        plan = self._plan()
        return self._dequantized(plan, dtype, keep_quantized)

    def _plan(self) -> list[_Planned]:
        """What each tensor becomes; raises on an unsupported type or unknown name."""
        spec, plan = self._spec, []
        bad = [(f, t) for f, t in self._tensors.values() if t.tensor_type not in SUPPORTED_TENSOR_TYPES]
        if bad:
            (file, t), more = bad[0], f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
            raise UnsupportedTensorTypeError(
                f"{file}: tensor {t.name!r} has type {t.tensor_type.name}{more}, which this loader cannot "
                f"dequantize; supported: {', '.join(q.name for q in SUPPORTED_TENSOR_TYPES)}"
            )
        later_parts = {part for j in spec.joins.values() for part in j.parts[1:]}
        for name, (file, t) in self._tensors.items():
            base, _, suffix = name.rpartition(".")
            key, bid = _table_key(base)
            if key in _NON_HF_TENSORS or f"{key}.{suffix}" in later_parts:
                continue  # (a join's later part is read with its first)
            hf_base = spec.names.get(key)
            if hf_base is None or suffix not in ("weight", "bias"):
                raise UnexpectedWeightError(
                    f"{file}: GGUF tensor {name!r} has no HF name ({self.architecture})"
                )
            fix = spec.fixes.get(key)
            if "{xid}" not in hf_base:
                hf_name = hf_base.format(bid=bid)
                hf_name = hf_name if hf_name.endswith("_weight") else f"{hf_name}.{suffix}"
                join = spec.joins.get(f"{key}.{suffix}")
                parts = () if join is None else self._join_parts(join, bid, file)
                plan.append(_Planned(name, hf_name, fix, join=join, parts=parts))
                continue
            if len(t.shape) != (
                3 if suffix == "weight" else 2
            ):  # ggml order: [in, out, experts] / [out, experts]
                raise ModelLoadError(
                    f"{file}: expert tensor {name!r} has shape {t.shape.tolist()}, not a stack of {suffix}es"
                )
            num_experts = int(t.shape[-1])
            plan += [
                _Planned(name, f"{hf_base.format(bid=bid, xid=e)}.{suffix}", fix, e, e == num_experts - 1)
                for e in range(num_experts)
            ]
        return plan

    def _join_parts(self, join: Join, bid: str | None, file: str) -> tuple[str, ...]:
        """The GGUF names of a join's parts in block `bid`, each checked to be in the file."""
        names = tuple(part.format(bid=bid) for part in join.parts)
        for name in names:
            if name not in self._tensors:
                raise ModelLoadError(
                    f"{file}: tensor {name!r} is missing (with {names[0]!r}, one HF tensor's parts: "
                    f"{', '.join(names)})"
                )
        return names

    def _dequantized(
        self, plan: list[_Planned], dtype: torch.dtype, keep_quantized: Callable[[str], bool] | None
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedRows, str]]:
        readers = dict(zip(map(str, self.parts), self._readers, strict=True))
        for p in plan:
            file, t = self._tensors[p.name]
            if p.join is not None:
                yield p.hf_name, self._joined(p, dtype, keep_quantized), file
                continue
            # One expert of a stacked tensor is its slice along the outermost (ggml's last) axis.
            data, shape = (
                (t.data, t.shape.tolist()) if p.expert is None else (t.data[p.expert], t.shape[:-1].tolist())
            )
            if keep_quantized is not None and t.tensor_type in EXACT_TYPES and keep_quantized(p.hf_name):
                rows = self._quantized_rows(data, t.tensor_type, shape, p.fix)
                if rows is not None:
                    yield p.hf_name, rows, file
                    if p.last_of_tensor:
                        _drop_mapped_pages(readers[file], t)
                    continue
            # dequantize gives float32 in the logical (row-major) shape: ggml's dims reversed.
            arr = dequantize(data, t.tensor_type)
            assert arr.shape == tuple(reversed(shape)), (p.name, arr.shape, shape)
            if not arr.flags.writeable:  # F32 comes back as a read-only view of the memory map
                arr = np.array(arr)
            tensor = torch.from_numpy(arr)
            if p.fix is not None:
                tensor = p.fix(tensor, self)  # in float32, before rounding to `dtype`
            yield p.hf_name, tensor.to(dtype), file
            if p.last_of_tensor:
                _drop_mapped_pages(readers[file], t)

    def _quantized_rows(
        self, data: np.ndarray, qtype: GGMLQuantizationType, shape: list[int], fix: Fix | None
    ) -> QuantizedRows | None:
        """A 2-D tensor (ggml `shape` [in, out]) as block-quantized rows with `fix` applied, or
        None where the fix is not a reordering of rows (the caller then takes the float path)."""
        if len(shape) != 2:
            return None
        rows = read_rows(np.asarray(data), qtype, int(shape[0]))
        if rows is None or fix is None:
            return rows
        order = row_order(fix, rows.num_rows, self)
        return None if order is None else rows.select_rows(order)

    def _joined(
        self, p: _Planned, dtype: torch.dtype, keep_quantized: Callable[[str], bool] | None
    ) -> torch.Tensor | QuantizedRows:
        """A join's parts put back into one HF tensor: block rows concatenated as they are where
        every part keeps its blocks (a cat along rows), else float32 parts joined, then `dtype`."""
        assert p.join is not None and p.fix is None
        tensors = [self._tensors[name][1] for name in p.parts]
        if keep_quantized is not None and keep_quantized(p.hf_name) and p.join.dim == 0 and not p.join.stack:
            rows = [
                read_rows(np.asarray(t.data), t.tensor_type, int(t.shape[0]))
                if t.tensor_type in EXACT_TYPES and len(t.shape) == 2
                else None
                for t in tensors
            ]
            if all(r is not None for r in rows):
                joined = QuantizedRows.concat(rows)  # type: ignore[arg-type]
                if joined is not None:
                    return joined
        arrays = [np.asarray(dequantize(t.data, t.tensor_type)) for t in tensors]
        return p.join([torch.from_numpy(np.array(a)) for a in arrays]).to(dtype)
