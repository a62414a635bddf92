"""`FusedDecoder`: a decoder stack's whole forward in one C++ call (Llama-family stacks, Gemma 2 and 3,
OLMo 2, EXAONE 4.0; csrc/decoder_stack.cpp), for any flat batch: decodes, prompt chunks, or both.

With quantized weights the model's layer-by-layer forward is mostly glue: at batch 1 on a 2-core
CPU, ten torch/Python calls per layer cost about as much as the quantized matmuls themselves. The
fused decoder runs the same math (models/llama.py) on the same quantized weights and the same
paged KV cache, layer after layer, in C++ with the GIL released; the model keeps its
layer-by-layer path for anything the fused one does not take (`unsupported_reason`). A step with
LoRA adapters runs here too, each token adding its own adapter's deltas (csrc/decoder_lora.cpp;
lora/fused.py hands the adapters over and says which ones it cannot take).

A model describes its stack with a `DecoderSpec` (models are architecture only; this module
knows nothing of checkpoints or configs). Tensors are passed to C++ by address: the spec's
modules and the runner's KV caches own them, and this object keeps references to both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.layers.activation import fused_gated_name
from llmserve.layers.attention import AttentionMetadata, LayerKVCache
from llmserve.layers.layernorm import LayerNorm, RMSNorm
from llmserve.layers.linear import Linear
from llmserve.layers.moe import SparseMoE
from llmserve.layers.quantization import cpu_kernels
from llmserve.layers.quantization.layers import QuantizedLinear
from llmserve.layers.rotary_embedding import RotaryEmbedding

_CACHE_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}


@dataclass(frozen=True, slots=True)
class DecoderLayerSpec:
    input_norm: RMSNorm | LayerNorm | None  # None (and post_norm None): a post-norm layer reads the stream
    qkv: Linear  # [q | k | v] rows
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    o: Linear
    post_norm: RMSNorm | LayerNorm | None
    gate_up: (
        Linear | None
    )  # [gate | up] rows (the up rows alone when not `gated`); None where `moe` is the MLP
    down: Linear | None
    sliding_window: int | None
    rope: bool = True
    """Whether the layer rotates q and k (False: a NoPE layer, SmolLM3's every fourth)."""
    moe: SparseMoE | None = None
    """A mixture-of-experts MLP (run by csrc/decoder_moe.cpp) instead of gate_up / down."""
    post_attn_norm: RMSNorm | None = None
    """Gemma's sandwich norms: the attention's output normed before it joins the residual stream,"""
    post_mlp_norm: RMSNorm | None = None
    """and the MLP's."""
    rotary: RotaryEmbedding | None = None
    """This layer's own RoPE (Gemma 3's sliding and global layers have two bases); None: the stack's."""
    qk_norm_whole: bool = False
    """q_norm and k_norm over all of a token's heads at once (OLMo 2), not head by head."""
    gated: bool = True
    """False: a plain MLP, down(act(up x)), `gate_up` the up projection alone (StarCoder2's c_fc)."""


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    """A decoder stack: RMSNorm, GQA attention with RoPE, RMSNorm, gated MLP (pre-norm, as Llama's;
    Gemma's sandwich norms and OLMo 2's post-norm layers through the layers' optional norms)."""

    layers: list[DecoderLayerSpec]
    final_norm: RMSNorm | LayerNorm
    rotary: RotaryEmbedding
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    eps: float
    activation: str
    """The gated MLP's: "silu", or the tanh GELU under any of its names (Gemma's gelu_pytorch_tanh)."""
    residual_scale: float = 1.0
    """What each sublayer's output is multiplied by as it joins the residual stream (Granite)."""
    softcap: float | None = None
    """Gemma 2's cap c on the scaled attention scores: c tanh(s / c)."""
    layer_norm: bool = False
    """The input, post-attention and final norms are LayerNorms with biases (StarCoder2), not RMSNorms."""


LORA_LINEARS = ("qkv", "o", "gate_up", "down")
"""The `DecoderLayerSpec` linear layers the fused decoder adds LoRA deltas to, in the order of
csrc/decoder_stack.h's kLora* indices (lora/fused.py passes an adapter's pairs in it)."""


_ACTIVATIONS = {"silu_and_mul": 0, "gelu_tanh_and_mul": 1}  # csrc/decoder_stack.h's kActSilu, kActGeluTanh


def _norms(layer: DecoderLayerSpec) -> list[RMSNorm]:
    norms = (
        layer.input_norm,
        layer.q_norm,
        layer.k_norm,
        layer.post_norm,
        layer.post_attn_norm,
        layer.post_mlp_norm,
    )
    return [n for n in norms if n is not None]


def _rotaries(spec: DecoderSpec) -> list[RotaryEmbedding]:
    """The stack's RoPE and each layer's own, once each."""
    found = {id(spec.rotary): spec.rotary}
    for layer in spec.layers:
        if layer.rotary is not None:
            found.setdefault(id(layer.rotary), layer.rotary)
    return list(found.values())


def _bias(norm: RMSNorm | LayerNorm | None) -> int:
    """A LayerNorm's bias address (0: none, or an RMSNorm)."""
    bias = getattr(norm, "bias", None)
    return 0 if bias is None else bias.data_ptr()


def _norm_weight(norm: RMSNorm | LayerNorm) -> torch.Tensor:
    """The weight the C++ norm multiplies by: w, or Gemma's (1 + w) added once in float32, the value
    the model's own norm computes at every call."""
    offset = getattr(norm, "weight_offset", 0.0)  # (a LayerNorm has none)
    return norm.weight if not offset else (norm.weight.float() + offset).contiguous()


def unsupported_reason(spec: DecoderSpec, kv_caches: list[LayerKVCache]) -> str | None:
    """Why the fused decoder cannot run this stack (None: it can); a tensor-parallel rank's
    shard runs the same (its row-parallel and MoE outputs summed over the group in the call)."""
    rotaries = _rotaries(spec)
    if not all(r.backend_can_rotate for r in rotaries):  # its RoPE takes one position a token
        return "M-RoPE (three position ids a token)"
    if not cpu_kernels.has_native_kernels():
        return f"quantized kernel set is {cpu_kernels.kernels()!r}"
    if fused_gated_name(spec.activation) not in _ACTIVATIONS:
        return f"activation {spec.activation!r}"
    if (
        any(layer.moe is not None for layer in spec.layers)
        and fused_gated_name(spec.activation) != "silu_and_mul"
    ):
        return f"MoE experts with activation {spec.activation!r}"
    if (
        not all(layer.gated for layer in spec.layers)
        and fused_gated_name(spec.activation) != "gelu_tanh_and_mul"
    ):
        return f"a plain MLP with activation {spec.activation!r} (the C++ one is the tanh GELU)"
    dims = {r.rotary_dim for r in rotaries}
    if len(dims) > 1 or spec.rotary.rotary_dim % 2 or spec.rotary.rotary_dim > spec.head_dim:
        return "rotary dims"
    for layer in spec.layers:
        linears = [layer.qkv, layer.o, *_mlp_linears(layer)]
        if not all(isinstance(m, QuantizedLinear) and m.packed_weights() for m in linears):
            return "float linear layers"
        if any(m.input_perm is not None for m in linears):  # type: ignore[union-attr]
            return "act-order input permutations (GPTQ desc_act)"
        if layer.moe is not None and any(
            w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous()
            for w in _routers(layer.moe)
        ):
            return "MoE router weights are not float32 on the CPU"
        if layer.moe is not None and (
            layer.moe.gate.bias is not None or layer.moe.experts[0].glu is not None
        ):
            return "MoE routing the C++ decoder lacks (router bias, gpt-oss's gating)"
        for n in [*_norms(layer), spec.final_norm]:
            if any(
                t is not None and (t.dtype != torch.float32 or t.device.type != "cpu")
                for t in (n.weight, getattr(n, "bias", None))
            ):
                return "norm weights are not float32 on the CPU"
    for cache in kv_caches:
        for half in (cache[0], cache[1]):
            if half.device.type != "cpu" or half.dtype not in _CACHE_TYPES or not half.is_contiguous():
                return f"KV cache {half.dtype} on {half.device}"
    if len({_v_offset(c) for c in kv_caches}) > 1:
        return "layers' V halves sit at different offsets from their K halves"
    return None


def _v_offset(cache: LayerKVCache) -> int:
    """Bytes from a layer's K half to its V half: Hkv x K's head bytes in a single tensor, K's
    bytes rounded up to the pair's alignment in a `KVPair` (K and V of two types)."""
    return cache[1].data_ptr() - cache[0].data_ptr()


def _mlp_linears(layer: DecoderLayerSpec) -> list[Linear]:
    """The MLP's linear layers: gate_up and down, or every expert's (and the shared expert's)."""
    if layer.moe is None:
        return [layer.gate_up, layer.down]  # type: ignore[list-item]
    experts = [
        *layer.moe.experts,
        *([layer.moe.shared_expert] if layer.moe.shared_expert is not None else []),
    ]
    return [lin for e in experts for lin in (e.gate_up_proj, e.down_proj)]


def _routers(moe: SparseMoE) -> list[torch.Tensor]:
    gate = moe.shared_expert_gate
    return [moe.gate.weight, *([gate.weight] if gate is not None else [])]


def _moe(moe: SparseMoE | None) -> tuple | None:
    """A MoE block as decoder_new takes it (csrc/module.cpp, parse_moe), or None for a dense MLP."""
    if moe is None:
        return None
    shared, gate = moe.shared_expert, moe.shared_expert_gate
    return (
        moe.num_experts,
        moe.top_k,
        # a softmax over the k chosen logits (Granite MoE) is the softmax over all of them
        # renormalised over the chosen: e^z_i / sum_chosen e^z_j either way
        int(moe.renormalize or moe.softmax_after_top_k),
        moe.gate.weight.data_ptr(),
        [_linear(e.gate_up_proj) for e in moe.experts],  # type: ignore[arg-type]
        [_linear(e.down_proj) for e in moe.experts],  # type: ignore[arg-type]
        None if shared is None else _linear(shared.gate_up_proj),  # type: ignore[arg-type]
        None if shared is None else _linear(shared.down_proj),  # type: ignore[arg-type]
        0 if gate is None else gate.weight.data_ptr(),
    )


def _linear(m: QuantizedLinear) -> tuple[int, ...] | list[tuple[int, ...]]:
    """A layer as decoder_new takes it: (bits, w, d, m, bias, N, K, act_bits), or a list of
    them for a layer split by its shards' formats (int16 activations: `keep_shard_formats`)."""
    addr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    if m.qweight is not None:
        w = m.qweight
        return (w.code, w.data.data_ptr(), w.d.data_ptr(), addr(w.m), addr(m.bias), w.out_features,
                w.in_features, m.act_bits)  # fmt: skip
    parts, col = [], 0
    for w in m.parts:  # each matrix's rows of the bias
        bias = 0 if m.bias is None else m.bias.data_ptr() + 4 * col
        parts.append(
            (w.code, w.data.data_ptr(), w.d.data_ptr(), addr(w.m), bias, w.out_features, w.in_features, 16)
        )
        col += w.out_features
    return parts


class FusedDecoder:
    """Runs `spec`'s forward over `kv_caches` for a flat batch of tokens. `comm`: a tensor-parallel
    rank's shared-memory group (distributed/shm.py's handle), when `spec` is its shard: the
    spec's heads, KV heads and intermediate size are then the rank's, and the o and down
    projections' partial outputs are summed over the ranks inside the C++ call, as the layer
    path's hooks do (distributed/sharding.py); the embedding and LM head stay vocab-parallel."""

    def __init__(
        self, spec: DecoderSpec, kv_caches: list[LayerKVCache], block_size: int, comm: object | None = None
    ) -> None:
        reason = unsupported_reason(spec, kv_caches)
        if reason is not None:
            raise ValueError(f"the fused decoder cannot run this model: {reason}")
        self.spec, self.kv_caches = spec, kv_caches
        k0, v0 = kv_caches[0][0], kv_caches[0][1]  # K and V halves (their own types in a KVPair)
        # [max_pos, rot] tables: the stack's, then any layer's own (kept alive here, as the norms'
        # offset weights are: the C++ side holds their addresses)
        self._tables = {
            id(r): r.cos_sin_table(torch.device("cpu")).float().contiguous() for r in _rotaries(spec)
        }
        self._cos_sin = self._tables[id(spec.rotary)]
        self._max_position = min(t.shape[0] for t in self._tables.values())
        self._norm_weights = {id(n): _norm_weight(n) for layer in spec.layers for n in _norms(layer)}
        self._norm_weights[id(spec.final_norm)] = _norm_weight(spec.final_norm)
        addr = lambda n: 0 if n is None else self._norm_weights[id(n)].data_ptr()  # noqa: E731
        layers = []
        for layer, kv in zip(spec.layers, kv_caches, strict=True):
            layers.append(
                (
                    addr(layer.input_norm),
                    _linear(layer.qkv),  # type: ignore[arg-type]
                    addr(layer.q_norm),
                    addr(layer.k_norm),
                    _linear(layer.o),  # type: ignore[arg-type]
                    addr(layer.post_norm),
                    None if layer.moe is not None else _linear(layer.gate_up),  # type: ignore[arg-type]
                    None if layer.moe is not None else _linear(layer.down),  # type: ignore[arg-type]
                    kv[0].data_ptr(),
                    int(layer.sliding_window or 0),
                    _moe(layer.moe),
                    int(layer.rope),
                    addr(layer.post_attn_norm),
                    addr(layer.post_mlp_norm),
                    0 if layer.rotary is None else self._tables[id(layer.rotary)].data_ptr(),
                    int(layer.qk_norm_whole),
                    _bias(layer.input_norm),
                    _bias(layer.post_norm),
                    int(layer.gated),
                )
            )
        self.capsule: object
        """The C++ decoder (what a LoRA adapter's capsule is built against)."""
        config = (
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            spec.rotary.rotary_dim,
            spec.intermediate_size,
            k0.shape[1],  # num_blocks
            block_size,
            self._max_position,
            float(spec.eps),
            float(spec.scale),
            _CACHE_TYPES[k0.dtype],
            _CACHE_TYPES[v0.dtype],
            _v_offset(kv_caches[0]),
            float(spec.residual_scale),
            _ACTIVATIONS[fused_gated_name(spec.activation)],  # type: ignore[index]
            float(spec.softcap or 0.0),
            int(spec.layer_norm),  # csrc/decoder_stack.h's kNormRms, kNormLayer
            _bias(spec.final_norm),
        )
        self._comm = comm  # kept alive with the decoder, which holds its address
        self.capsule = cpu_kernels.decoder_new(
            config, layers, self._cos_sin.data_ptr(), addr(spec.final_norm), comm
        )
        self.cache_ptr = k0.data_ptr()

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
        lora: tuple[tuple[object, ...], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x [T, hidden] float32 (the batch's new tokens, embedded), positions [T] int64 -> final
        hidden states [T, hidden]. `lora`: the step's adapters (`cpu_kernels.decoder_lora_new`
        capsules, lora/fused.py builds them) and each token's index among them [T] int64 (-1:
        the base model)."""
        T = x.shape[0]
        x = x.contiguous()
        positions = positions.contiguous()
        out = torch.empty_like(x)
        if max(md.seq_lens) > self._max_position:  # the C++ side indexes the tables unchecked
            raise ValueError(
                f"context of {max(md.seq_lens)} tokens is past the rotary table ({self._max_position})"
            )
        if md.num_seqs == T:  # one token per sequence
            token_seqs = torch.arange(T)
        else:
            token_seqs = torch.repeat_interleave(torch.arange(md.num_seqs), torch.tensor(md.query_lens))
        tables = md.block_tables
        cpu_kernels.decoder_forward(
            self.capsule,
            x.data_ptr(),
            T,
            positions.data_ptr(),
            md.slot_mapping.data_ptr(),
            token_seqs.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            () if lora is None else lora[0],
            0 if lora is None else lora[1].data_ptr(),
            out.data_ptr(),
        )
        return out
