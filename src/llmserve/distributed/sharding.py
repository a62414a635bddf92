"""How a Llama-family model (dense or mixture-of-experts) is cut into tensor-parallel shards
(Megatron's split):

    qkv_proj, gate_up_proj   column-parallel: each rank computes its heads / its slice of the
                             intermediate dimension (rows [r*n, (r+1)*n) of each checkpoint tensor)
    o_proj, down_proj        row-parallel: each rank multiplies its slice of the input columns;
                             the partial outputs are summed by one all-reduce after self_attn and
                             one after the MLP (a bias is added by rank 0 only)
    embed_tokens             vocab-parallel: rank r holds rows [r*Vr, (r+1)*Vr) (the vocabulary
                             padded to tp * Vr with zero rows); ids outside are looked up as 0,
                             then zeroed, and the all-reduce leaves each id's row
    lm_head                  vocab-parallel: each rank's [N, Vr] logits gathered on the driver
                             and concatenated, the padding cut off
    norms, rotary            replicated
    MoE blocks               the router (and a shared expert's sigmoid gate) replicated, so every
                             rank picks the same experts; every expert's gate_up_proj column-split
                             and down_proj row-split on its intermediate dimension, the shared
                             expert as a dense MLP: each rank's block output is its share of every
                             chosen expert's, and the one all-reduce after the MLP sums them
                             (gpt-oss: its stacked expert tensors cut before they are split per
                             expert, `_stacked_experts`; its attention sinks split by head)

A rank builds the model from `local_config` (its heads, KV heads, intermediate slice and
vocabulary shard), so each layer allocates only its shard and the KV cache is sharded by KV head
for free; `shard_tensor` cuts every checkpoint tensor as it streams past (safetensors: only this
rank's rows or columns are read from the file; GGUF: one tensor is read at a time, then cut), and `parallelize` installs the collectives as forward
hooks, so the model's code stays the single-device architecture.

Quantized rows (q8 / q4, blocks of 32 input columns) are split by rows for column-parallel layers
(any row count) and along whole blocks for row-parallel ones: o_proj's and down_proj's input
slices must be multiples of 32 columns. q6 rows (GGUF Q6_K's super-blocks of 256 columns) split
the same way along whole super-blocks; a row-parallel slice that cuts one arrives as floats (the
file's values) and its layer holds it as q8, what Q6_K tensors were before q6. q4k rows (GGUF
Q4_K's super-blocks kept) stay q4k where a slice is whole super-blocks of 256 columns, else become
q4 rows (the same values) before the cut.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmserve.distributed.group import TPGroup
from llmserve.layers.quantization.formats import BLOCK, SUPER_BLOCK, QuantizedRows, num_blocks
from llmserve.layers.quantization.formats_q6 import SUB as Q6_SUB
from llmserve.layers.quantization.formats_q6 import SUPER as Q6_SUPER
from llmserve.layers.vocab_embedding import LMHead, VocabEmbedding
from llmserve.models.base import CausalLM
from llmserve.models.gpt_oss import STACKED_EXPERTS

_COLUMN = frozenset({"qkv_proj", "gate_up_proj", "c_fc"})  # (c_fc, c_proj: StarCoder2's MLP)
_ROW = frozenset({"o_proj", "down_proj", "c_proj"})
SUPPORTED = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma2ForCausalLM",
    "GraniteForCausalLM",
    "GraniteMoeForCausalLM",
    "Exaone4ForCausalLM",
    "Phi3ForCausalLM",
    "Starcoder2ForCausalLM",
    "Olmo2ForCausalLM",
)
"""Model classes tensor parallelism splits (Mistral and SmolLM3 checkpoints run on
LlamaForCausalLM; Phi-3's fused and Granite MoE's stacked checkpoint tensors are cut after the
loader splits them into the parts the model loads). OLMo 2's q and k norms span every head: a
rank's norm sums its heads' squares over the group (`parallelize`). Not the multimodal models."""
_SPLIT_WIDTHS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
"""The MLP widths a shard holds 1 / size of: a dense MLP's, each expert's, the shared expert's
(Mixtral's experts are `intermediate_size` wide)."""


@dataclass(slots=True)
class TPShard:
    """This process's place in a tensor-parallel engine."""

    rank: int
    size: int
    group: TPGroup | None = field(default=None, repr=False)
    """Joined after loading on the driver (it loads before starting the workers)."""

    def require_group(self) -> TPGroup:
        assert self.group is not None, "the tensor-parallel group is not joined yet"
        return self.group


def check_supported(model_cls: type[CausalLM], hf_config: Any, size: int) -> None:
    """Raise ValueError unless `model_cls` with `hf_config` splits into `size` shards."""
    name = model_cls.__name__
    if name not in SUPPORTED:
        raise ValueError(
            f"tensor parallelism does not support the {name} architecture "
            f"(architectures {getattr(hf_config, 'architectures', None)}); supported: {', '.join(SUPPORTED)}"
        )
    for field_name in ("num_attention_heads", "num_key_value_heads", *_SPLIT_WIDTHS):
        value = int(getattr(hf_config, field_name, 0) or 0)  # (0: a width this model lacks)
        if value % size:
            raise ValueError(
                f"tensor_parallel_size {size} does not divide the model's {field_name} ({value}); "
                f"use a size that divides it"
            )


def local_vocab(vocab_size: int, size: int) -> int:
    """Rows of the vocabulary each rank holds (the last ranks' tails padded with zero rows)."""
    return -(-vocab_size // size)


def local_config(hf_config: Any, size: int) -> Any:
    """The config a rank builds its shard from: its heads, KV heads, MLP slices (dense, expert and
    shared-expert widths) and vocabulary rows; everything else (hidden size, head_dim, RoPE, the
    number of experts) as the model's."""
    from llmserve.models.llama import head_dim_of

    config = copy.deepcopy(hf_config)
    config.head_dim = head_dim_of(hf_config)  # no longer hidden_size / heads once heads are split
    config.num_attention_heads = hf_config.num_attention_heads // size
    config.num_key_value_heads = hf_config.num_key_value_heads // size
    for width in _SPLIT_WIDTHS:
        if getattr(hf_config, width, None):
            setattr(config, width, getattr(hf_config, width) // size)
    config.vocab_size = local_vocab(hf_config.vocab_size, size)
    return config


# -- slicing checkpoint tensors --------------------------------------------------------------------


def _shape(t: Any) -> list[int]:
    """A tensor's shape, or a safetensors slice's (read from the file's header)."""
    return list(t.get_shape()) if hasattr(t, "get_shape") else list(t.shape)


def _rows(t: Any, start: int, n: int) -> torch.Tensor | QuantizedRows:
    """Rows [start, start + n) of t, padded with zero rows past its end (the vocabulary's tail).
    `t`: a tensor, quantized rows, or a safetensors slice (only these rows are read)."""
    if isinstance(t, QuantizedRows):
        take = max(0, min(n, t.num_rows - start))

        def pad(x: torch.Tensor) -> torch.Tensor:
            out = x[start : start + take]
            if take == n:
                return out
            return torch.cat([out, x.new_zeros((n - take, *x.shape[1:]))])

        m, sc = (None if s is None else pad(s) for s in (t.m, t.scales))
        return QuantizedRows(t.fmt, pad(t.q), pad(t.d), m, t.in_features, sc)
    total = _shape(t)[0]
    take = max(0, min(n, total - start))
    out = t[start : start + take] if take else t[0:0]
    return out if take == n else torch.cat([out, out.new_zeros((n - take, *out.shape[1:]))])


def _columns(name: str, t: Any, start: int, n: int) -> torch.Tensor | QuantizedRows:
    """Input columns [start, start + n) of a weight [out, in] (a tensor, quantized rows split on
    whole blocks, or a safetensors slice)."""
    if not isinstance(t, QuantizedRows):
        return t[:, start : start + n]
    end = start + n
    if t.fmt == "q6":
        return _q6_columns(t, start, n)
    if start % BLOCK or (end % BLOCK and end != t.in_features):
        raise ValueError(
            f"{name}: a row-parallel shard of {n} input columns does not fall on whole blocks of {BLOCK} "
            f"(quantized weights split only along whole blocks); use a tensor_parallel_size that does"
        )
    b0, nb = start // BLOCK, num_blocks(n)
    if t.fmt == "q4k":  # d, dmin per super-block: cut on whole ones, else as q4 (the same values)
        if start % SUPER_BLOCK == 0 and n % SUPER_BLOCK == 0:
            s0, ns = start // SUPER_BLOCK, n // SUPER_BLOCK
            d, dmin = t.d[:, s0 : s0 + ns], t.m[:, s0 : s0 + ns]  # type: ignore[index]
            return QuantizedRows("q4k", t.q[:, start:end], d, dmin, n, t.scales[:, b0 : b0 + nb])  # type: ignore[index]
        t = t.as_q4()
    m = None if t.m is None else t.m[:, b0 : b0 + nb]
    return QuantizedRows(t.fmt, t.q[:, start : start + nb * BLOCK], t.d[:, b0 : b0 + nb], m, n)


def _q6_columns(t: QuantizedRows, start: int, n: int) -> torch.Tensor | QuantizedRows:
    """Columns [start, start + n) of q6 rows: rows of whole super-blocks, else the file's values
    as floats (the layer then holds them as q8; `as_rows`)."""
    if start % Q6_SUPER or n % Q6_SUPER:
        return t.dequantize()[:, start : start + n]
    s0, j0 = start // Q6_SUPER, start // Q6_SUB
    assert t.scales is not None
    return QuantizedRows(
        "q6",
        t.q[:, start : start + n],
        t.d[:, s0 : s0 + n // Q6_SUPER],
        None,
        n,
        t.scales[:, j0 : j0 + n // Q6_SUB],
    )


def shard_tensor(model: CausalLM, name: str, tensor: Any, shard: TPShard) -> torch.Tensor | QuantizedRows:
    """This rank's part of checkpoint tensor `name` (as the full model stores it): a tensor,
    quantized rows, or a safetensors slice, of which only this part is read."""
    stacked = STACKED_EXPERTS.match(name)
    if stacked is not None:
        return _stacked_experts(stacked.group(2), stacked.group(3) or "", tensor, shard)
    route = model.route_weight(name)
    if route is None:
        return tensor[:] if hasattr(tensor, "get_shape") else tensor
    module_path, attr, index = route
    if attr == "sinks":  # gpt-oss's per-head sink logits [num_heads]: the rank's heads
        n = _shape(tensor)[0] // shard.size
        return _rows(tensor, shard.rank * n, n)
    module = model.get_submodule(module_path)
    leaf = module_path.rpartition(".")[2]
    r = shard.rank
    if isinstance(module, (VocabEmbedding, LMHead)):
        return _rows(tensor, r * module.vocab_size, module.vocab_size)
    if leaf in _COLUMN:
        n = module.output_sizes[index]
        return _rows(tensor, r * n, n)
    if leaf in _ROW:
        if attr == "bias":  # added once, by rank 0, to the summed output
            return tensor[:] if r == 0 else torch.zeros(_shape(tensor))
        return _columns(name, tensor, r * module.in_features, module.in_features)
    if leaf in ("q_norm", "k_norm") and _shape(tensor)[0] != module.weight.shape[0]:
        n = module.weight.shape[0]  # a norm over every head (OLMo 2): the rank's heads' weights
        return _rows(tensor, r * n, n)
    return tensor[:] if hasattr(tensor, "get_shape") else tensor


def _stacked_experts(proj: str, kind: str, t: Any, shard: TPShard) -> torch.Tensor:
    """This rank's part of one of gpt-oss's stacked expert tensors (models/gpt_oss.py), cut before
    they are split per expert, on the experts' intermediate dimension I (n = I / size a rank):

        gate_up_proj       [E, H, 2I]   gate and up units interleaved (column 2i gate unit i, 2i + 1
                                        up unit i), so the rank's units are the contiguous columns
                                        [2rn, 2(r+1)n); its bias [E, 2I] the same
        down_proj          [E, I, H]    rows [rn, (r+1)n); its bias [E, H] rank 0's, zeros elsewhere
        MXFP4 *_blocks     [E, out, in / 32, 16] and *_scales [E, out, in / 32]: gate_up's rows
                           as above, down's input on whole blocks of 32
    """
    shape, r, size = _shape(t), shard.rank, shard.size
    if proj == "down_proj" and kind == "_bias":  # added once, by rank 0, to the summed output
        return t[:] if r == 0 else torch.zeros(shape)
    axis = {("gate_up_proj", ""): 2, ("gate_up_proj", "_bias"): 1, ("down_proj", ""): 1}.get((proj, kind))
    if axis is None:  # MXFP4 codes or scales: gate_up's output rows, down's input blocks
        axis = 1 if proj == "gate_up_proj" else 2
    if shape[axis] % size:
        raise ValueError(
            f"gpt-oss's {proj}{kind} {shape}: dimension {axis} does not split into {size} tensor-parallel "
            f"shards (MXFP4 weights split only along whole blocks of 32)"
        )
    n = shape[axis] // size
    index = [slice(None)] * len(shape)
    index[axis] = slice(r * n, (r + 1) * n)
    return t[tuple(index)]


# -- collectives as hooks --------------------------------------------------------------------------


def parallelize(model: CausalLM, shard: TPShard, vocab_size: int) -> None:
    """Install the shard's collectives on a loaded model: an all-reduce after each layer's
    attention and MLP, the vocab-parallel lookup and the gathered LM head (`vocab_size`: the
    model's full vocabulary, where the gathered logits are cut)."""
    backbone = getattr(model, model.backbone_name)
    for layer in backbone.layers:
        for module in (layer.self_attn, layer.mlp):
            module.register_forward_hook(lambda _m, _args, out: shard.require_group().all_reduce(out))
        if getattr(layer.self_attn, "norms_span_heads", False):  # OLMo 2's q and k norms
            _sum_squares_over_ranks(layer.self_attn.q_norm, shard)
            _sum_squares_over_ranks(layer.self_attn.k_norm, shard)
    _vocab_parallel_embedding(backbone.embed_tokens, shard)
    _gathered_head(model.lm_head, shard, vocab_size)


def _sum_squares_over_ranks(norm: nn.Module, shard: TPShard) -> None:
    """An RMSNorm over every head (OLMo 2's q and k), of which each rank holds its heads' part:
    x / sqrt(mean of x^2 over all the ranks' parts + eps) * w, the squares summed over the group."""
    width = norm.weight.shape[0] * shard.size

    def forward(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = shard.require_group().all_reduce(xf.pow(2).sum(-1, keepdim=True).contiguous())  # [T, 1]
        return norm.weight * (xf * torch.rsqrt(squares / width + norm.eps)).to(x.dtype)

    norm.forward = forward


def _vocab_parallel_embedding(embed: nn.Module, shard: TPShard) -> None:
    """ids outside this rank's rows look up row 0, are zeroed, and the all-reduce sums in the
    one rank that holds each id."""
    start = shard.rank * embed.vocab_size
    outside: list[torch.Tensor] = []  # the pre-hook's mask, for the hook of the same call

    def pre(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        local = args[0] - start
        mask = (local < 0) | (local >= embed.vocab_size)
        outside.append(mask)
        return (local.masked_fill(mask, 0), *args[1:])

    def post(_m: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.masked_fill(outside.pop().unsqueeze(-1), 0.0)
        return shard.require_group().all_reduce(out)

    embed.register_forward_pre_hook(pre)
    embed.register_forward_hook(post)


def _gathered_head(head: nn.Module, shard: TPShard, vocab_size: int) -> None:
    """Each rank's [N, Vr] logits concatenated on the driver ([N, vocab]); a worker's own
    shard is returned to it (nobody reads it)."""

    def post(_m: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        parts = shard.require_group().gather_to_driver(out)
        return out if parts is None else torch.cat(parts, dim=-1)[..., :vocab_size]

    head.register_forward_hook(post)


# -- LoRA adapters ---------------------------------------------------------------------------------


def shard_lora_pair(
    module_path: str, a: torch.Tensor, b: torch.Tensor, shard: TPShard, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of one projection's LoRA pair (A [r, in], B [out, r]), as punica / vLLM
    shard them: a column-parallel layer's B cut to the rank's output rows (its A, over the whole
    replicated input, kept), a row-parallel layer's A cut to the rank's input columns (its
    partial delta then summed by the layer's all-reduce, B kept). `where`: the file and layer,
    for the ValueError of a size that does not split."""
    leaf = module_path.rpartition(".")[2]
    if leaf in _COLUMN:
        dim, n = "lora_B's rows", b.shape[0]
    elif leaf in _ROW:
        dim, n = "lora_A's columns", a.shape[-1]
    else:
        return a, b
    if n % shard.size:
        raise ValueError(f"{where}: {dim} ({n}) do not split into {shard.size} tensor-parallel shards")
    part, start = n // shard.size, shard.rank * (n // shard.size)
    if leaf in _COLUMN:
        return a, b[start : start + part]
    return a[:, start : start + part], b
