"""Pre-quantized checkpoints written the way their tools write them, for tests: GPTQ (AutoGPTQ's v1
and gptqmodel's v2 zero points, act-order), AWQ (GEMM packing) and FP8 (per tensor / per channel),
each returning the tensors to save and the dequantized float weight the format defines.

Written from the formats' rules, independently of llmserve's readers:

    GPTQ  qweight [K/8, N] int32: q[n, 8i + j] in bits 4j of word (i, n); qzeros [G, N/8]: z[g, 8c + j]
          in bits 4j of word (g, c), stored as z - 1 in v1; w = s[g] (q - z[g]), g = g_idx[k]
    AWQ   qweight [K, N/8] int32: q[8c + ORDER[j], k] in bits 4j of word (k, c), ORDER = 0 2 4 6 1 3 5 7;
          qzeros the same; w = s[g] (q - z[g]), g = k // group_size
    FP8   weight e4m3 [N, K], weight_scale float32 [] (tensor) or [N, 1] (channel); w = q s
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _words(nibbles: np.ndarray) -> torch.Tensor:
    """[..., 8] values 0..15 -> [...] int32 words, value j in bits 4j."""
    acc = np.zeros(nibbles.shape[:-1], np.uint32)
    for j in range(8):
        acc |= (nibbles[..., j].astype(np.uint32) & 0xF) << np.uint32(4 * j)
    return torch.from_numpy(acc.view(np.int32))


def _group_quantize(cols: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows' columns of one group [N, n] -> (q [N, n] 0..15, z [N], s [N] fp16), AutoGPTQ's quantizer."""
    lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
    if sym:
        hi = torch.maximum(lo.abs(), hi)
        lo = -hi
    s = ((hi - lo) / 15).clamp(min=1e-5).half()
    z = torch.full_like(s, 8, dtype=torch.int64) if sym else torch.round(-lo / s.float()).clamp(0, 15).long()
    q = torch.clamp(torch.round(cols / s.float()[:, None]) + z[:, None], 0, 15).long()
    return q, z, s


def gptq(
    w: torch.Tensor, group_size: int, sym: bool, order: torch.Tensor | None, v1: bool
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """w [N, K] -> GPTQ tensors and the dequantized weight. `order`: act-order's quantization order
    (GPTQ sorts columns by the Hessian's diagonal): column order[i] falls in group i // group_size."""
    N, K = w.shape
    gs = K if group_size == -1 else group_size
    G = -(-K // gs)
    g_idx = torch.empty(K, dtype=torch.int64)
    g_idx[torch.arange(K) if order is None else order] = torch.arange(K) // gs
    q = torch.zeros(N, K, dtype=torch.int64)
    zeros, scales = torch.zeros(G, N, dtype=torch.int64), torch.zeros(G, N, dtype=torch.float16)
    for g in range(G):
        cols = g_idx == g
        q[:, cols], zeros[g], scales[g] = _group_quantize(w[:, cols].float(), sym)
    stored_z = (zeros - 1) & 0xF if v1 else zeros  # v1: z - 1 (0 wraps to 15, read back as 16)
    tensors = {
        "qweight": _words(q.T.reshape(K // 8, 8, N).permute(0, 2, 1).numpy()),
        "qzeros": _words(stored_z.reshape(G, N // 8, 8).numpy()),
        "scales": scales,
        "g_idx": g_idx.int(),
    }
    z_read = stored_z + 1 if v1 else stored_z
    deq = (q - z_read[g_idx].T).float() * scales[g_idx].T.float()
    return tensors, deq


def awq(w: torch.Tensor, group_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """w [N, K] -> AWQ GEMM tensors (asymmetric, zero points) and the dequantized weight."""
    N, K = w.shape
    G = K // group_size
    q = torch.zeros(N, K, dtype=torch.int64)
    zeros, scales = torch.zeros(G, N, dtype=torch.int64), torch.zeros(G, N, dtype=torch.float16)
    for g in range(G):
        cols = slice(g * group_size, (g + 1) * group_size)
        q[:, cols], zeros[g], scales[g] = _group_quantize(w[:, cols].float(), sym=False)

    def pack(v: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N / 8], AWQ's interleaving
        return _words(v.reshape(v.shape[0], -1, 8)[..., AWQ_ORDER].numpy())

    g_idx = torch.arange(K) // group_size
    deq = (q - zeros[g_idx].T).float() * scales[g_idx].T.float()
    return {"qweight": pack(q.T), "qzeros": pack(zeros), "scales": scales}, deq


def fp8(
    w: torch.Tensor, per_channel: bool, scale_dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """w [N, K] -> e4m3 weight and scale (per tensor: one; per channel: [N, 1])."""
    amax = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax()
    scale = (amax.float() / 448).to(scale_dtype)
    q = (w / scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
    input_scale = torch.tensor(0.05, dtype=scale_dtype)  # a static activation scale: not used
    return {"weight": q, "weight_scale": scale, "input_scale": input_scale}, q.float() * scale.float()


def write_prequantized(
    folder: Path, hf: torch.nn.Module, quantization_config: dict, quantize_one, layers: str = r"_proj"
) -> None:
    """Replace the saved float checkpoint in `folder` with one whose linear layers (names containing
    `layers`, except lm_head) are `quantize_one(name, w) -> (tensors, dequantized)`; load the
    dequantized weights into `hf`, the reference; add `quantization_config` to config.json."""
    path = folder / "model.safetensors"
    with safe_open(str(path), framework="pt") as sf:
        state = {k: sf.get_tensor(k) for k in sf.keys()}  # noqa: SIM118
    out, reference = {}, hf.state_dict()
    for name, w in state.items():
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and layers in name and "lm_head" not in name and w.dim() == 2:
            tensors, deq = quantize_one(prefix, w)
            out.update({f"{prefix}.{k}": v.contiguous() for k, v in tensors.items()})
            reference[name] = deq
        else:
            out[name] = w
    save_file(out, str(path))
    hf.load_state_dict(reference)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
