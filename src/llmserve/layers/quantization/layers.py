"""Block-quantized counterparts of the float layers: `QuantizedLinear`, `QuantizedVocabEmbedding`
and `QuantizedLMHead`. They take the same checkpoint tensors through the same loading calls
(`load_shard`, `load`), as floats (quantized here) or as `QuantizedRows` straight from a GGUF file,
and hold only the packed weight: no float copy exists at any point.

A fused layer (qkv, gate_up) receives its shards one at a time; their rows wait in logical form
until the last one arrives, and are then packed into tiles and dropped, so at most one layer's
staging copy exists while a model loads.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.layers.linear import Linear
from llmserve.layers.quantization import cpu_kernels
from llmserve.layers.quantization.formats import (
    PackedWeight,
    PermutedRows,
    QuantFormat,
    QuantizedRows,
    pack,
    quantize,
)
from llmserve.layers.vocab_embedding import LMHead, VocabEmbedding
from llmserve.load_errors import WeightShapeError


def as_rows(
    name: str, loaded: torch.Tensor | QuantizedRows, fmt: QuantFormat, shape: tuple[int, int]
) -> QuantizedRows:
    """A checkpoint tensor [out, in] as rows in `fmt`: float tensors are quantized; 4-bit rows
    become 8-bit ones exactly (same scales and minimums, a symmetric block's -8 d stored), 8-bit
    and 6-bit rows are requantized from their float values; q4k rows are a q4 layer's as they are
    (the same values). q6 holds only GGUF Q6_K's own blocks: anything else meant for a q6 layer (a
    tensor-parallel shard cut inside a super-block, which arrives as floats) becomes q8, what Q6_K
    tensors became before q6 existed."""
    if fmt == "q6" and not (isinstance(loaded, QuantizedRows) and loaded.fmt == "q6"):
        fmt = "q8"
    if isinstance(loaded, QuantizedRows):
        got = (loaded.num_rows, loaded.in_features)
        if got != shape:
            raise WeightShapeError(name, shape, got)
        if loaded.fmt == fmt or (loaded.fmt == "q4k" and fmt == "q4"):
            return loaded
        loaded = loaded.as_q4()  # q4k to any other format: as q4 first (the same values)
        if loaded.fmt == fmt:
            return loaded
        if fmt == "q8" and loaded.fmt == "q4":  # values 0..15 fit int8: w = d q + m is kept as it is
            return QuantizedRows(
                "q8", loaded.q.to(torch.int8), loaded.d, loaded.minimums(), loaded.in_features
            )
        return quantize(loaded.dequantize(), fmt)
    if tuple(loaded.shape) != shape:
        raise WeightShapeError(name, shape, tuple(loaded.shape))
    return quantize(loaded, fmt)


def _concat(parts: list[QuantizedRows]) -> QuantizedRows:
    """A fused layer's shards (all in the layer's format, or q6 and q8 where a q6 layer's shard
    fell back to q8: all q8 then) as one matrix. The kernels take one kind of minimum per matrix,
    so where the shards disagree every one has its minimums stored: q4's symmetric -8 d, q8's
    zeros. Only shards that all lack them (e.g. every one Q4_0) store none."""
    if len(parts) == 1:
        return parts[0]
    if len({p.fmt for p in parts}) > 1:
        parts = [as_rows("", p, "q8", (p.num_rows, p.in_features)) for p in parts]
    if parts[0].fmt in ("q6", "q4k"):  # all q6 or all q4k: their own fields side by side
        joined = QuantizedRows.concat(parts)
        assert joined is not None
        return joined
    m = None
    if any(p.m is not None for p in parts):
        stored = [p.minimums() for p in parts]
        m = torch.cat(
            [s if s is not None else torch.zeros_like(p.d) for s, p in zip(stored, parts, strict=True)]
        )
    return QuantizedRows(
        parts[0].fmt,
        torch.cat([p.q for p in parts]),
        torch.cat([p.d for p in parts]),
        m,
        parts[0].in_features,
    )


def _common_perm(name: str, perms: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The one input permutation of a fused layer's shards. One matmul gathers its input once, so
    the shards (q, k, v; gate, up) must agree; GPTQ gives them the same g_idx, as they share
    their input and so the Hessian its act-order sorts by."""
    first = perms[0]
    for p in perms[1:]:
        if (p is None) != (first is None) or (p is not None and not torch.equal(p, first)):
            raise ValueError(
                f"{name}: the shards of this fused layer have different act-order permutations "
                f"(g_idx); llmserve runs a fused layer with one input permutation"
            )
    return first


class QuantizedLinear(Linear):
    """y = x @ W.T + b with W block-quantized (q8, q4 or q6); computes in float32, returns x's dtype."""

    packed = True  # forward takes and gives the plain [..., in] -> [..., out] layout

    def __init__(self, in_features: int, output_sizes: list[int] | int, bias: bool, fmt: QuantFormat) -> None:
        nn.Module.__init__(self)
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.in_features = in_features
        self.out_features = sum(self.output_sizes)
        self.fmt = fmt
        self.bias = (
            nn.Parameter(torch.zeros(self.out_features, dtype=torch.float32), requires_grad=False)
            if bias
            else None
        )
        self.qweight: PackedWeight | None = None
        self.parts: list[PackedWeight] = []
        """A fused layer whose shards came in different formats (`keep_shard_formats`): its
        matrices, rows one after another (then `qweight` is None)."""
        self.keep_shard_formats = False
        """Keep the 4-bit and q6 shards of this 8-bit layer as matrices of their own (GGUF files
        under `auto`: Q4_K_M's Q4_K q and k as q4k beside a Q6_K v as q6) instead of widening them
        into one q8 matrix with minimums. Rows are independent and q4 -> q8 is exact, so the 4-bit
        shards' outputs are the same bits, and q6 holds the file's values; the split matrices run
        with int16 activations (`act_bits` 16), as the q8 matrix did whatever `act_bits` said."""
        self.act_bits = 16  # 8: int8 activations for q4 weights (ModelConfig.cpu_activations)
        self.input_perm: torch.Tensor | None = None
        """[in] int64: the input's columns in the weight's column order (GPTQ act-order), gathered
        before every matmul; None: the natural order."""
        self._staged: list[QuantizedRows | None] = [None] * len(self.output_sizes)
        self._staged_perms: list[torch.Tensor | None] = [None] * len(self.output_sizes)

    @classmethod
    def like(cls, layer: Linear, fmt: QuantFormat) -> QuantizedLinear:
        """A quantized layer with `layer`'s shape (its float weight is never filled)."""
        return cls(layer.in_features, layer.output_sizes, layer.bias is not None, fmt)

    def packed_weights(self) -> list[PackedWeight]:
        """The matrices the layer multiplies by: `qweight`, or the split layer's `parts`."""
        return self.parts if self.qweight is None else [self.qweight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_perm is not None:  # one gather of the activations (act-order checkpoints)
            x = x.index_select(-1, self.input_perm)
        if self.qweight is None:
            assert self.parts, "weights not loaded"
            return cpu_kernels.linear(x, self.parts, self.bias, 16)  # int16: see keep_shard_formats
        return cpu_kernels.linear(x, self.qweight, self.bias, self.act_bits)

    def load_shard(
        self,
        name: str,
        loaded: torch.Tensor | QuantizedRows | PermutedRows,
        shard: int = 0,
        is_bias: bool = False,
    ) -> None:
        start, end = self._shard_range(shard)
        if is_bias:
            assert self.bias is not None, f"{name}: this layer has no bias"
            if tuple(loaded.shape) != (end - start,):
                raise WeightShapeError(name, (end - start,), tuple(loaded.shape))
            self.bias.data[start:end].copy_(loaded)  # type: ignore[arg-type]
            return
        if isinstance(loaded, PermutedRows):
            self._staged_perms[shard] = loaded.perm
            loaded = loaded.rows
        shape = (end - start, self.in_features)
        kept = isinstance(loaded, QuantizedRows) and loaded.fmt in ("q4", "q4k", "q6")
        if self.keep_shard_formats and kept:  # q4k stays q4k, Q6_K's q6 stays q6 (as_rows)
            self._staged[shard] = as_rows(name, loaded, "q6" if loaded.fmt == "q6" else "q4", shape)
        else:
            self._staged[shard] = as_rows(name, loaded, self.fmt, shape)
        if all(s is not None for s in self._staged):
            self.input_perm = _common_perm(name, self._staged_perms)
            self._pack_staged(name)
            self._staged = [None] * len(self.output_sizes)
            self._staged_perms = [None] * len(self.output_sizes)

    def _pack_staged(self, name: str) -> None:
        """The staged shards as one matrix in the layer's format, or, where 4-bit shards were kept
        beside 8-bit ones, as one matrix per run of consecutive shards of one format."""
        staged: list[QuantizedRows] = self._staged  # type: ignore[assignment]
        formats = {s.fmt for s in staged}
        if {"q4", "q4k"} <= formats:  # q4k beside q4 shards: one q4 matrix
            staged = [s.as_q4() for s in staged]
        if len({s.fmt for s in staged}) == 1:  # one format: the layer's (4-bit shards widened if kept)
            shape = lambda s: (s.num_rows, s.in_features)  # noqa: E731
            self.qweight = pack(_concat([as_rows(name, s, self.fmt, shape(s)) for s in staged]))
            if self.fmt == "q6":  # q8 where a shard fell back (as_rows); a q4 layer's q4k stays "q4"
                self.fmt = self.qweight.fmt
            self.parts = []
            return
        runs: list[list[QuantizedRows]] = []
        for s in staged:
            if runs and runs[-1][0].fmt == s.fmt:
                runs[-1].append(s)
            else:
                runs.append([s])
        self.qweight = None
        self.parts = [pack(_concat(run)) for run in runs]

    def use_onednn(self) -> None:
        """Nothing to repack: the quantized kernels have their own layout."""

    def logical_weight(self) -> torch.Tensor:
        """The dequantized [out, in] weight (for inspection and tests; allocates a float copy)."""
        from llmserve.layers.quantization.formats import unpack

        parts = self.packed_weights()
        assert parts, "weights not loaded"
        w = torch.cat([unpack(p).dequantize() for p in parts])
        if self.input_perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.input_perm] = w  # back to the input's column order
        return out

    def extra_repr(self) -> str:
        fmt = "+".join(p.fmt for p in self.parts) if self.qweight is None and self.parts else self.fmt
        return f"in={self.in_features}, out={self.output_sizes}, bias={self.bias is not None}, {fmt}"


class QuantizedVocabEmbedding(VocabEmbedding):
    """Embedding rows dequantized on lookup from a block-quantized [vocab, hidden] table, which a
    tied `QuantizedLMHead` multiplies by as its weight."""

    def __init__(self, vocab_size: int, hidden_size: int, fmt: QuantFormat, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.vocab_size, self.hidden_size, self.fmt, self.dtype = vocab_size, hidden_size, fmt, dtype
        self.weight_t = None
        self.weight = None
        self.qweight: PackedWeight | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        assert self.qweight is not None, "weights not loaded"
        out = cpu_kernels.embedding(input_ids, self.qweight)
        return out if self.dtype == torch.float32 else out.to(self.dtype)

    def use_rows(self) -> None:
        """Already rows."""

    def load(self, name: str, loaded: torch.Tensor | QuantizedRows) -> None:
        self.qweight = pack(as_rows(name, loaded, self.fmt, (self.vocab_size, self.hidden_size)))
        self.fmt = self.qweight.fmt

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, hidden={self.hidden_size}, {self.fmt}"


class QuantizedLMHead(LMHead):
    """logits = hidden @ W.T with W block-quantized: the tied embedding's table, or its own."""

    def __init__(
        self, vocab_size: int, hidden_size: int, fmt: QuantFormat, tied_to: QuantizedVocabEmbedding | None
    ) -> None:
        nn.Module.__init__(self)
        self.vocab_size, self.hidden_size, self.fmt = vocab_size, hidden_size, fmt
        self.tied_to = tied_to is not None
        # Registered under the model's own name first (named_modules() lists it once, there).
        self.tied_embedding = tied_to
        self.weight_t = None
        self.weight = None
        self.qweight: PackedWeight | None = None
        self.act_bits = 16  # QuantizedLinear.act_bits

    @property
    def packed_weight(self) -> PackedWeight:
        w = self.tied_embedding.qweight if self.tied_embedding is not None else self.qweight
        assert w is not None, "weights not loaded"
        return w

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        return cpu_kernels.linear(hidden, self.packed_weight, act_bits=self.act_bits)

    def use_onednn(self, tied_to: VocabEmbedding | None) -> None:
        """The quantized kernels have their own layout."""

    def load(self, name: str, loaded: torch.Tensor | QuantizedRows) -> None:
        self.qweight = pack(as_rows(name, loaded, self.fmt, (self.vocab_size, self.hidden_size)))
        self.fmt = self.qweight.fmt

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, hidden={self.hidden_size}, {self.fmt}, tied={self.tied_to}"


def packed_weights(model: nn.Module) -> list[PackedWeight]:
    """Every matrix that the model's loaded quantized linear layers and LM head multiply by (a
    tied head's is the embedding's table)."""
    found: list[PackedWeight] = []
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            found += module.packed_weights()
        elif isinstance(module, QuantizedLMHead):
            found.append(module.packed_weight)
    return found
