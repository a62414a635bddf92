"""The grouped MoE Triton kernels (layers/triton_moe.py) against the torch path they replace
(moe.py's `grouped_forward`, each expert a `GatedMLP`), the routing metadata's invariants, and the
model path: tiny Mixtral and Qwen2-MoE (shared expert) models whose MoE blocks run the kernel,
against their own grouped path and transformers.

Without CUDA the kernels run on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before triton is imported); with CUDA the same tests run compiled, plus the
`gpu` ones at a Mixtral-like width and under a CUDA graph.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from llmserve.config import ModelConfig
from llmserve.layers.moe import SparseMoE, use_moe_kernel
from llmserve.layers.quantization import cpu_kernels
from llmserve.layers.triton_moe import align_routing, fused_moe, pick_block_m
from llmserve.model_executor.device import build_profile
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.model_loader import load_model
from tests.models.tiny import make_tiny_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def make_moe(hidden: int, num_experts: int, inter: int, dtype: torch.dtype, act: str = "silu") -> SparseMoE:
    torch.manual_seed(0)
    with torch.device(DEVICE):
        moe = SparseMoE(hidden, num_experts, 2, inter, act, renormalize=True)
    for p in moe.parameters():
        p.data.normal_(0, 0.2)
    return moe.to(dtype).eval()


def experts_of(moe: SparseMoE) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, H, 2I] and w2 [E, I, H] as the kernel reads them (copies: `moe` is left alone)."""
    w13 = torch.stack([m.gate_up_proj.logical_weight().t() for m in moe.experts]).contiguous()
    w2 = torch.stack([m.down_proj.logical_weight().t() for m in moe.experts]).contiguous()
    return w13, w2


def routing(num_tokens: int, num_experts: int, chosen: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Top-2 choices among the first `chosen` experts only (the rest chosen by no token) and
    renormalised weights."""
    g = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack([torch.randperm(chosen, generator=g)[:2] for _ in range(num_tokens)]).to(DEVICE)
    weights = torch.rand(num_tokens, 2, generator=g).to(DEVICE)
    return (weights / weights.sum(-1, keepdim=True)).to(dtype), ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "chosen", "hidden", "act"),
    [
        (1, 4, 4, 32, "silu"),  # decode: one token, two experts run
        (7, 8, 5, 64, "silu"),  # three experts chosen by no token
        (17, 4, 4, 48, "gelu_pytorch_tanh"),  # 34 pairs: runs of 16-row blocks, padded
        (40, 8, 3, 32, "silu"),  # 80 pairs on three experts: more than one block each
        (70, 4, 4, 32, "silu"),  # 140 pairs > 32 per expert: 64-row blocks
    ],
)
def test_kernel_equals_the_grouped_torch_path(dtype, num_tokens, num_experts, chosen, hidden, act) -> None:
    moe = make_moe(hidden, num_experts, 40, dtype, act)  # I 40: not a multiple of the 64-column tile
    x = torch.randn(num_tokens, hidden, device=DEVICE).to(dtype)
    weights, ids = routing(num_tokens, num_experts, chosen, dtype)
    w13, w2 = experts_of(moe)
    with torch.no_grad():
        expected = moe.grouped_forward(x, weights, ids)
        out = fused_moe(x, w13, w2, weights, ids, act)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_no_tokens_and_unknown_activations() -> None:
    moe = make_moe(32, 4, 40, torch.float32)
    w13, w2 = experts_of(moe)
    x = torch.empty(0, 32, device=DEVICE)
    ids = torch.empty(0, 2, dtype=torch.int64, device=DEVICE)
    assert fused_moe(x, w13, w2, torch.empty(0, 2, device=DEVICE), ids, "silu").shape == (0, 32)
    with pytest.raises(ValueError, match="'relu'"):
        fused_moe(x, w13, w2, torch.empty(0, 2, device=DEVICE), ids, "relu")


@pytest.mark.parametrize(("num_tokens", "chosen"), [(1, 4), (9, 3), (33, 8)])
def test_routing_metadata_sorts_pairs_into_one_expert_blocks(num_tokens: int, chosen: int) -> None:
    num_experts, block_m = 8, 16
    _, ids = routing(num_tokens, num_experts, chosen, torch.float32)
    meta = align_routing(ids, num_experts, block_m)
    pairs = meta.sorted_pairs.view(meta.num_blocks, block_m).cpu()
    block_expert = meta.block_expert.cpu()
    flat = ids.reshape(-1).cpu()
    num_pairs = flat.numel()
    real = pairs[pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair once
    for b in range(meta.num_blocks):
        rows = pairs[b][pairs[b] < num_pairs]
        if block_expert[b] == num_experts:  # past the last run: no work, no pairs
            assert rows.numel() == 0
        else:  # a block holds one expert's pairs, at least one of them
            assert rows.numel() > 0 and (flat[rows] == block_expert[b]).all()
    used = block_expert[block_expert < num_experts]
    assert set(used.tolist()) == set(flat.tolist())  # an expert no token chose has no block
    assert (used[1:] >= used[:-1]).all()  # runs in expert order


def test_routing_metadata_needs_no_host_sync() -> None:
    """On the meta device any read of a value (a `.item()`, `bincount`'s size) raises: the metadata's
    shapes follow from T, k and the expert count alone, so the step can be a CUDA graph."""
    ids = torch.empty(40, 2, dtype=torch.int64, device="meta")
    meta = align_routing(ids, 8, pick_block_m(80, 8))
    assert meta.sorted_pairs.shape == (meta.num_blocks * 16,) and meta.num_blocks == (80 + 8 * 15 + 15) // 16


@pytest.mark.parametrize("arch", ["mixtral", "qwen2-moe"])
def test_models_run_the_kernel_and_match_transformers(tmp_path: Path, arch: str) -> None:
    """The loader's seam (`use_moe_kernel`, what `DeviceProfile.moe_kernel` picks on CUDA) applied
    to a CPU model: its MoE blocks stack their experts and run the kernel; logits equal the grouped
    path's and transformers'. (`blas` keeps the float layout the kernel reads: oneDNN-packed
    experts would take the dense path.)"""
    hf = make_tiny_model(arch, tmp_path)
    cpu = DEVICE.type == "cpu"  # on CUDA the kernel runs compiled, in float32 (tl.dot rounds in TF32)
    kw: dict = {"cpu_gemm": "blas"} if cpu else {"dtype": "float32"}
    loaded = load_model(ModelConfig(model=str(tmp_path), device=DEVICE.type, show_progress=False, **kw))
    assert loaded.profile.moe_kernel == ("grouped" if cpu else "triton")  # the CPU's default is left alone
    if not cpu:
        use_moe_kernel(loaded.model, "grouped")  # the host-grouped path, to compare with
    prompt = [3, 17, 250, 9, 41, 8, 100, 7, 7, 300, 12, 1, 2, 480, 5, 66, 19]

    def logits() -> torch.Tensor:
        runner = ForwardRunner(loaded.model, num_blocks=8, block_size=4, profile=loaded.profile)
        return runner.execute(
            [SequenceBatchEntry(prompt, len(prompt), list(range(5)))], all_logits=True
        ).cpu()

    grouped = logits()
    assert use_moe_kernel(loaded.model, "triton") == "experts run triton"
    blocks = [m for m in loaded.model.modules() if isinstance(m, SparseMoE)]
    assert blocks and all(m.kernel == "triton" and m.w13 is not None for m in blocks)
    kernel = logits()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    tol = (1e-5, 1e-4) if cpu else (1e-3, 1e-3)
    torch.testing.assert_close(kernel, grouped, rtol=tol[0], atol=tol[0])
    torch.testing.assert_close(kernel, expected, rtol=tol[1], atol=tol[1])


def test_experts_the_kernel_does_not_take_run_dense(tmp_path: Path) -> None:
    if not cpu_kernels.has_native_kernels():  # int8 experts need the C++ extension
        pytest.skip("llmserve's C++ kernels are not built here")
    make_tiny_model("mixtral", tmp_path)
    loaded = load_model(
        ModelConfig(model=str(tmp_path), device="cpu", quantization="int8", show_progress=False)
    )
    assert use_moe_kernel(loaded.model, "triton") == "experts run dense"  # q8 experts
    relu = make_moe(32, 4, 40, torch.float32, act="relu")
    assert relu.use_kernel("triton") == "dense" and relu.w13 is None


def test_profile_picks_the_kernel_per_device() -> None:
    assert build_profile(torch.device("cpu")).moe_kernel == "grouped"
    assert build_profile(torch.device("cuda"), "torch").moe_kernel == "triton"  # triton imports here


def test_stacked_experts_are_views_of_one_copy() -> None:
    """Where a weight is one chunk (every accelerator), the experts' own parameters become views
    of the stacked tensors: the weights are not held twice."""
    with torch.device(DEVICE):
        torch.manual_seed(0)
        moe = SparseMoE(32, 4, 2, 40, "silu", renormalize=True)
    for p in moe.parameters():  # the router's weight too: torch.empty's memory may hold NaNs
        p.data.normal_(0, 0.2)
    for m in moe.experts:  # one chunk, as on CUDA
        m.gate_up_proj.weight = torch.nn.Parameter(torch.randn(1, 32, 80, device=DEVICE), requires_grad=False)
        m.down_proj.weight = torch.nn.Parameter(torch.randn(1, 40, 32, device=DEVICE), requires_grad=False)
    before = [m.gate_up_proj.weight.clone() for m in moe.experts]
    assert moe.use_kernel("triton") == "triton"
    assert moe.w13 is not None and moe.w2 is not None
    for e, m in enumerate(moe.experts):
        assert m.gate_up_proj.weight.untyped_storage().data_ptr() == moe.w13.untyped_storage().data_ptr()
        assert m.down_proj.weight.untyped_storage().data_ptr() == moe.w2.untyped_storage().data_ptr()
        assert torch.equal(m.gate_up_proj.weight, before[e])
    x = torch.randn(5, 32, device=DEVICE)
    with torch.no_grad():
        weights, ids = moe.route(x)
        torch.testing.assert_close(moe(x), moe.grouped_forward(x, weights, ids), rtol=2e-5, atol=2e-5)


def test_long_eager_steps_run_grouped(monkeypatch) -> None:
    """Under `triton`, a step of GROUPED_FROM_TOKENS tokens or more runs the experts grouped on the
    host (cuBLAS beats the kernel's tiles there), a shorter one runs the kernel; the same numbers."""
    import llmserve.layers.moe as moe_module
    import llmserve.layers.triton_moe as triton_moe

    moe = make_moe(32, 4, 40, torch.float32)
    assert moe.use_kernel("triton") == "triton"
    ran: list[str] = []
    real_grouped, real_fused = moe.grouped_forward, triton_moe.fused_moe
    monkeypatch.setattr(moe, "grouped_forward", lambda *a: (ran.append("grouped"), real_grouped(*a))[1])
    monkeypatch.setattr(triton_moe, "fused_moe", lambda *a: (ran.append("triton"), real_fused(*a))[1])
    monkeypatch.setattr(moe_module, "GROUPED_FROM_TOKENS", 12)
    x = torch.randn(12, 32, device=DEVICE)
    with torch.no_grad():
        long, short = moe(x), moe(x[:11])
    assert ran == ["grouped", "triton"]
    torch.testing.assert_close(long[:11], short, rtol=2e-5, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 16, 300])
def test_kernel_at_mixtral_width_and_in_a_cuda_graph_gpu(num_tokens: int) -> None:
    """bf16 at hidden 1024, 8 experts of 1792: the kernel against the grouped torch path, and
    captured in a CUDA graph (no host sync) replaying to the eager result on new routing."""
    moe = make_moe(1024, 8, 1792, torch.bfloat16)
    w13, w2 = experts_of(moe)
    x = torch.randn(num_tokens, 1024, device=DEVICE).to(torch.bfloat16)
    weights, ids = routing(num_tokens, 8, 8, torch.bfloat16)
    with torch.no_grad():
        expected = moe.grouped_forward(x, weights, ids)
        torch.testing.assert_close(
            fused_moe(x, w13, w2, weights, ids, "silu"), expected, rtol=2e-2, atol=2e-2
        )
        fused_moe(x, w13, w2, weights, ids, "silu")  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fused_moe(x, w13, w2, weights, ids, "silu")
        new_weights, new_ids = routing(num_tokens + 1, 8, 5, torch.bfloat16)
        weights.copy_(new_weights[:num_tokens])
        ids.copy_(new_ids[:num_tokens])
        graph.replay()
        torch.testing.assert_close(captured, fused_moe(x, w13, w2, weights, ids, "silu"), rtol=0, atol=0)
