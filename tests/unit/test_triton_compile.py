"""The Triton kernels compiled for an H100 (sm_90) on a machine without a GPU, by triton's own
compiler down to SASS with its bundled ptxas. The interpreter tests (test_triton_kernels.py) run
kernels as Python; compiled Triton has stricter rules (static ifs, types, dot shapes, shared
memory), and a kernel can pass the first and fail the second (a tuple assignment of two dtypes
did). Each variant is built with the tile choices the launchers make.

Runs in a subprocess without TRITON_INTERPRET: under it, triton.jit builds interpreter functions,
which cannot be compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def _compile(fn, dtypes: dict[str, str], constexprs: dict, num_warps: int = 4, num_stages: int = 2) -> None:
    """Compile `fn` for sm_90: arguments named *_ptr point to dtypes[name] (default dtypes["*"]),
    floats named in dtypes are fp32, every other runtime argument is an i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + dtypes.get(name, dtypes["*"])
        else:
            signature[name] = dtypes.get(name, "i32")
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )


def _attention_variants() -> None:
    import triton

    from llmserve.layers.attention import triton_kernels as K

    np2 = triton.next_power_of_2
    part = {"part_acc_ptr": "fp32", "part_ml_ptr": "fp32", "seq_lens_ptr": "i32", "q_start_ptr": "i32"}
    # (dtype, head_dim, group, splits, window, block table dtype, sinks, softcap)
    for dt, D, group, splits, window, table, sinks, softcap in [
        ("bf16", 64, 4, 16, True, "i64", True, False),
        ("fp16", 80, 2, 1, False, "i32", True, True),
        ("fp32", 128, 1, 4, False, "i64", False, True),
    ]:
        types = {"*": dt, "table_ptr": table, "scale_log2": "fp32", "softcap": "fp32", **part}
        d_pad = max(16, np2(D))
        block_n, num_warps, num_stages = K._decode_tiles(d_pad)
        common = dict(HEAD_DIM=D, D_PAD=d_pad, BLOCK_N=block_n, HAS_WINDOW=window, HAS_SINKS=sinks)
        flags = dict(BLOCK_SIZE=16, GROUP=group, IEEE=dt == "fp32", UPCAST=False, SOFTCAP=softcap)
        _compile(
            K._decode_kernel,
            types,
            dict(**common, **flags, G_PAD=max(16, np2(group)), NUM_SPLITS=splits),
            num_warps,
            num_stages,
        )
        if splits > 1:
            _compile(K._merge_kernel, types, dict(**common, NUM_SPLITS=splits))
        block_q, block_n, num_warps, num_stages = K._varlen_tiles(d_pad, np2(group))
        common["BLOCK_N"] = block_n
        _compile(
            K._varlen_kernel,
            types,
            dict(**common, **flags, G_PAD=np2(group), BLOCK_Q=block_q),
            num_warps,
            num_stages,
        )


def _elementwise_variants() -> None:
    import triton

    from llmserve.layers import triton_ops as O
    from llmserve.layers.attention import triton_cache_ops as C

    np2 = triton.next_power_of_2
    for dt, cache_dt, H, H_kv, D, rotary_dim in [
        ("bf16", "bf16", 32, 8, 64, 64),
        ("fp32", "bf16", 14, 2, 128, 64),
    ]:
        types = {
            "*": dt,
            "cache_ptr": cache_dt,
            "positions_ptr": "i64",
            "cos_sin_ptr": "fp32",
            "slot_ptr": "i64",
        }
        half, pass_dims = rotary_dim // 2, D - rotary_dim
        constexprs = dict(
            NUM_HEADS=H, NUM_KV_HEADS=H_kv, HEAD_DIM=D, HALF=half, H_PAD=np2(H), HKV_PAD=np2(H_kv),
            HALF_PAD=np2(half), D_PAD=np2(D), PASS_PAD=np2(max(pass_dims, 1)), COPY_Q_PASS=pass_dims > 0,
        )  # fmt: skip
        _compile(C._rope_cache_kernel, types, constexprs)
        _compile(
            C._cache_write_kernel, types, dict(NUM_KV_HEADS=H_kv, HEAD_DIM=D, HKV_PAD=np2(H_kv), D_PAD=np2(D))
        )
    for gemma in (False, True):
        _compile(
            O._rms_norm_kernel,
            {"*": "bf16", "eps": "fp32", "offset": "fp32"},
            dict(HAS_RESIDUAL=True, GEMMA=gemma, ROUND_BEFORE_WEIGHT=True, BLOCK=2048),
            num_warps=8,
        )
    for gelu in (False, True):
        _compile(O._act_and_mul_kernel, {"*": "bf16"}, dict(GELU=gelu, BLOCK=1024))
    for dt, block in (("bf16", 2048), ("fp32", 8192)):  # fp8's activation rounding (the compiled branch)
        _compile(
            O._quantize_fp8_kernel,
            {"*": dt, "q_ptr": "u8", "s_ptr": "fp32", "inv_max": "fp32", "min_scale": "fp32"},
            dict(FP8_MAX=448.0, BLOCK=block),
            num_warps=8 if block <= 4096 else 16,
        )


def _moe_variants() -> None:
    from llmserve.layers import triton_moe as M

    types = {"*": "bf16", "pairs_ptr": "i32", "block_expert_ptr": "i32"}
    for dt in ("bf16", "fp16", "fp32"):
        types["*"] = dt
        for block_m in (M.pick_block_m(2, 8), M.pick_block_m(4096, 8)):  # decode and prefill tiles
            tiles = dict(
                BLOCK_M=block_m, BLOCK_N=M.BLOCK_N, BLOCK_K=M.BLOCK_K, IEEE=dt == "fp32", UPCAST=False
            )
            _compile(M._gate_up_kernel, types, dict(TOP_K=2, GELU=dt == "fp16", **tiles))
            _compile(M._down_kernel, types, tiles)


PER_STEP_INTS = {"num_seqs", "num_tokens", "num_rows", "num_pairs", "stride_bt"}
"""Runtime ints that change from step to step (the block table's width follows the batch in eager
steps). Triton compiles a variant per value class (== 1, divisible by 16, other); one first seen
mid-serving stalls that step for the compile (0.8 s on an H100), so kernels must not specialise
on them."""


def _per_step_ints_not_specialized() -> None:
    import triton

    from llmserve.layers import triton_moe, triton_ops
    from llmserve.layers.attention import triton_cache_ops, triton_kernels
    from llmserve.sample import philox_triton

    seen = set()
    for module in (triton_kernels, triton_cache_ops, triton_ops, triton_moe, philox_triton):
        for fn in vars(module).values():
            if not isinstance(fn, triton.runtime.jit.JITFunction):
                continue
            for param in fn.params:
                if param.name in PER_STEP_INTS and not param.is_constexpr:
                    seen.add(param.name)
                    assert param.do_not_specialize, f"{fn.__name__} specialises on {param.name}"
    assert {"num_seqs", "num_pairs", "stride_bt"} <= seen, seen


def test_kernels_compile_for_sm90() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == "compiled", proc.stdout


if __name__ == "__main__":
    _attention_variants()
    _elementwise_variants()
    _moe_variants()
    _per_step_ints_not_specialized()
    print("compiled")
