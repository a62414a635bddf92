"""Rotary position embeddings (RoPE), in the "half rotation" (GPT-NeoX / HF) layout: the first
half of each head's rotary dims pairs with the second half.

Frequencies follow the HF `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling`
(earlier versions): `default`, `linear`, `llama3`, `yarn` and `longrope` (their attention factors
scale the table, as HF scales cos and sin). The cos/sin table is a buffer built with the
module, on the device the model is built on (so nothing is created on another device at the first
forward), and indexed by position at each forward: by `cos_sin` once per forward for backends
that take rotated q and k, or inside the cache-write kernel of a backend that rotates q and k as it
writes K/V (`RotaryInputs` carries either to the attention layer).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE settings of an HF config as one dict with at least `rope_type` and `rope_theta`."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if layer_type is not None and layer_type in params:
            params = params[layer_type]
        if "rope_theta" in params:
            out = dict(params)
            out.setdefault("rope_type", out.pop("type", "default"))
            return _longrope_defaults(config, out)
    # transformers < 5: rope_theta plus an optional rope_scaling dict.
    out = dict(getattr(config, "rope_scaling", None) or {})
    out["rope_type"] = out.pop("type", out.get("rope_type", "default"))
    out["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return _longrope_defaults(config, out)


def _longrope_defaults(config: Any, params: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE's settings completed from the config, as transformers completes them: the original
    context (a config attribute in older files), and `factor` = max_position_embeddings / it."""
    if params["rope_type"] == "su":  # LongRoPE's first name (Phi-3's first configs)
        params["rope_type"] = "longrope"
    if params["rope_type"] != "longrope":
        return params
    original = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    if original is None:
        raise ValueError("rope_type longrope needs original_max_position_embeddings")
    params["original_max_position_embeddings"] = int(original)
    if params.get("factor") is None:
        params["factor"] = config.max_position_embeddings / int(original)
    return params


def rope_for_context(config: Any, max_model_len: int) -> Any:
    """`config`, or for LongRoPE a copy that says which of its two factor sets to use.

    LongRoPE (Phi-3, Phi-3.5, Phi-4-mini) divides each frequency by a per-dimension factor: the
    short set keeps the context the model was trained at, the long set stretches it to
    `max_position_embeddings`. transformers picks the set per forward by the largest position in
    it, so a sequence that crosses the original context attends over keys cached with the short
    set from queries rotated with the long one, and a batch's choice depends on its neighbours.
    llmserve picks once, by the context it serves, as llama.cpp and vLLM do: the long set when
    `max_model_len` exceeds the original context. The default `max_model_len` of such a model is
    the original context (model_loader's `_max_model_len`, vLLM's default too): the short set,
    which the model prefers for short prompts; `--max-model-len 131072` on Phi-3-mini-128k asks
    for the long one."""
    params = rope_parameters(config)
    if params["rope_type"] != "longrope":
        return config
    params["use_long_factor"] = max_model_len > params["original_max_position_embeddings"]
    config = copy.deepcopy(config)
    config.rope_parameters = params
    return config


def longrope_original_context(config: Any) -> int | None:
    """A LongRoPE model's original context (the default `max_model_len`), or None."""
    params = rope_parameters(config)
    return params["original_max_position_embeddings"] if params["rope_type"] == "longrope" else None


def longrope_note(config: Any) -> str:
    """For the load report: which LongRoPE factor set `rope_for_context` chose, or ""."""
    params = getattr(config, "rope_parameters", None)
    if (
        not isinstance(params, dict)
        or params.get("rope_type") != "longrope"
        or "use_long_factor" not in params
    ):
        return ""
    original = params["original_max_position_embeddings"]
    if params["use_long_factor"]:
        return f"; LongRoPE long factors (max_model_len over the original context of {original})"
    return f"; LongRoPE short factors (max_model_len within the original context of {original})"


def _inv_freq(rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu")  # the table is built on the CPU
    inv_freq = 1.0 / (base ** (steps.float() / rotary_dim))
    rope_type = params.get("rope_type") or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, rotary_dim, params)
    if rope_type == "longrope":  # one factor per frequency (rope_for_context picks the set)
        factors = params["long_factor" if params.get("use_long_factor") else "short_factor"]
        if len(factors) != rotary_dim // 2:
            raise ValueError(f"longrope: {len(factors)} factors for {rotary_dim // 2} rotary frequencies")
        # as transformers writes it (1 / (f * base^(2i/d)), not the default's 1 / base^(2i/d) / f)
        ext = torch.tensor(factors, dtype=torch.float32, device="cpu")
        return 1.0 / (ext * base ** (steps.float() / rotary_dim))
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(_SUPPORTED_ROPE_TYPES)}")


def _yarn_inv_freq(inv_freq: torch.Tensor, rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than `beta_slow` times over the original context are
    interpolated (divided by `factor`), those that turn more than `beta_fast` times are kept, and
    a linear ramp over the dimensions between them blends the two (HF's `_compute_yarn_parameters`)."""
    base, factor = float(params["rope_theta"]), float(params["factor"])
    old_len = float(params["original_max_position_embeddings"])
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def dim_of(turns: float) -> float:  # the dimension whose frequency turns `turns` times over old_len
        return rotary_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    dims = torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((dims - low) / (high - low)).clamp(0, 1)  # 0: kept (fast), 1: interpolated (slow)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _attention_factor(params: dict[str, Any]) -> float:
    """The factor YaRN and LongRoPE scale cos and sin by (1 for the other types)."""
    rope_type = params.get("rope_type") or "default"
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    if rope_type == "longrope":  # both factor sets: sqrt(1 + ln(factor) / ln(original context))
        factor = float(params["factor"])
        original = float(params["original_max_position_embeddings"])
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = float(params["factor"]), params.get("mscale"), params.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


class RotaryEmbedding(nn.Module):
    backend_can_rotate: ClassVar[bool] = True
    """Whether a backend that rotates q and k in its cache write (one table row per token, read at
    the token's position) can apply this RoPE; M-RoPE (layers/mrope.py) mixes three rows."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        inv_freq = _inv_freq(rotary_dim, params)  # validated here, at construction
        # Computed on the CPU in float32 (the same table on every device), then placed on the
        # device the model is being built on (torch's default device: the loader's, or meta).
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)  # [P, rotary_dim / 2]
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * _attention_factor(params)
        # [max_position, rotary_dim] as [cos of each frequency | sin of each frequency]
        self.register_buffer("cos_sin_cache", table.to(torch.get_default_device()), persistent=False)

    def cos_sin_table(self, device: torch.device) -> torch.Tensor:
        """[max_position, rotary_dim]: cos of each frequency, then sin, on `device` (the buffer
        itself when the model lives there, as it does for every forward)."""
        table = self.cos_sin_cache
        return table if table.device == device else table.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for `positions`, each [T, 1, rotary_dim], computed once per forward.

        With c, s the per-frequency halves: cos = [c | c] and sin = [-s | s], so that
        rotate_half(x) * [s | s] == roll(x, half) * [-s | s] and `forward` needs no negation.
        """
        return self._signed(self.cos_sin_cache.index_select(0, positions), dtype)

    def _signed(self, cs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, rotary_dim] rows of the table -> (cos, signed sin) as `cos_sin` returns them."""
        half = self.rotary_dim // 2
        cos = cs[:, :half].repeat(1, 2).unsqueeze(1).to(dtype)
        sin = cs[:, half:]
        sin = torch.cat((-sin, sin), dim=-1).unsqueeze(1).to(dtype)
        return cos, sin

    def forward(
        self,
        x: torch.Tensor,  # [T, n_heads, head_dim]
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        # x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2 | x1] = roll(x, half) * [-1 | 1].
        rd = self.rotary_dim
        if rd == self.head_dim:
            return x * cos + x.roll(rd // 2, dims=-1) * sin
        x_rot = x[..., :rd]
        out = x_rot * cos + x_rot.roll(rd // 2, dims=-1) * sin
        return torch.cat((out, x[..., rd:]), dim=-1)


@dataclass(frozen=True, slots=True)
class RotaryInputs:
    """One forward's RoPE for the layers that share `rope`, made once per forward by the model.

    `cos`/`sin` are set when the attention backend takes q and k already rotated; they are None
    when the backend rotates them itself as it writes K/V (`fuses_rope`), reading `rope`'s table
    at `positions` inside its kernel.
    """

    rope: RotaryEmbedding
    positions: torch.Tensor  # [T]
    cos: torch.Tensor | None = None  # [T, 1, rotary_dim]
    sin: torch.Tensor | None = None

    @classmethod
    def make(
        cls, rope: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype, in_backend: bool
    ) -> RotaryInputs:
        if in_backend and rope.backend_can_rotate:
            return cls(rope, positions)
        cos, sin = rope.cos_sin(positions, dtype)
        return cls(rope, positions, cos, sin)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:  # [T, n_heads, head_dim]
        assert self.cos is not None and self.sin is not None, "the backend rotates: nothing to apply"
        return self.rope(x, self.cos, self.sin)
