"""Shared layers against plain torch: the chunked input-major Linear (any chunk count, shards that
straddle chunk boundaries, bias), the chunked embedding/LM head, the same layers after repacking
for oneDNN, RMSNorm with the residual add fused (numba) or not, and paged attention metadata."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmserve.layers import layernorm, linear, onednn
from llmserve.layers.attention import AttentionMetadata
from llmserve.layers.layernorm import RMSNorm
from llmserve.layers.linear import Linear, num_weight_chunks
from llmserve.layers.mlp import GatedMLP
from llmserve.layers.vocab_embedding import LMHead, VocabEmbedding
from llmserve.load_errors import WeightShapeError


@pytest.fixture(params=[1, 2, 3, 4])
def threads(request, monkeypatch):
    """Chunk count follows the thread count at construction time (any chunk width allowed here,
    so that tiny layers split too)."""
    monkeypatch.setattr(linear, "MIN_CHUNK_COLUMNS", 1)
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@pytest.fixture(params=["chunked", "onednn"])
def kernel(request):
    """Run a layer as loaded (chunked, torch's bmm) or after `use_onednn` repacked it."""
    if request.param == "onednn" and not onednn.available():
        pytest.skip("this torch build has no working oneDNN")
    return request.param


# oneDNN sums in a different order than MKL: the same fp32 products, rounded differently.
ONEDNN_TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.mark.parametrize("M", [1, 5])
def test_fused_linear_matches_f_linear(threads, kernel, M):
    torch.manual_seed(0)
    sizes = [10, 7, 7]  # 24 columns; shards straddle chunk boundaries for 3 and 4 chunks
    layer = Linear(16, sizes, bias=True)
    assert layer.weight.shape[0] == threads
    parts = [torch.randn(n, 16) for n in sizes]
    biases = [torch.randn(n) for n in sizes]
    for i, (w, b) in enumerate(zip(parts, biases, strict=True)):
        layer.load_shard(f"w{i}", w, i)
        layer.load_shard(f"b{i}", b, i, is_bias=True)
    torch.testing.assert_close(layer.logical_weight(), torch.cat(parts))
    if kernel == "onednn":
        layer.use_onednn()
        assert layer.packed and layer.weight.is_mkldnn
    x = torch.randn(M, 16)
    ref = F.linear(x, torch.cat(parts), torch.cat(biases))
    torch.testing.assert_close(layer(x), ref, **ONEDNN_TOL)
    torch.testing.assert_close(layer(x.view(1, M, 16)), ref.view(1, M, -1), **ONEDNN_TOL)


def test_linear_shape_errors_name_the_tensor():
    layer = Linear(8, [4, 4])
    with pytest.raises(WeightShapeError, match=r"'q'.*\[4, 9\].*\[4, 8\]"):
        layer.load_shard("q", torch.zeros(4, 9), 0)


def test_tied_embedding_and_head(threads, kernel):
    torch.manual_seed(0)
    table = torch.randn(12, 6)  # [vocab, hidden]
    emb = VocabEmbedding(12, 6)
    emb.load("embed", table)
    head = LMHead(12, 6, tied_to=emb)
    with pytest.raises(WeightShapeError):
        emb.load("embed", torch.zeros(6, 12))
    if kernel == "onednn":
        emb.use_rows()
        head.use_onednn(emb)
        assert head.weight is emb.weight  # still one table
        assert emb.weight_t is None and head.weight_t is None
    ids = torch.tensor([0, 11, 5, 6, 5])
    torch.testing.assert_close(emb(ids), table[ids])
    h = torch.randn(3, 6)
    torch.testing.assert_close(head(h), h @ table.t(), **ONEDNN_TOL)


def test_untied_head_packs_its_own_table(threads, kernel):
    torch.manual_seed(0)
    table = torch.randn(40, 8)
    head = LMHead(40, 8)
    head.load("lm_head.weight", table)
    if kernel == "onednn":
        head.use_onednn(None)
        assert head.weight.is_mkldnn
    h = torch.randn(5, 8)
    torch.testing.assert_close(head(h), h @ table.t(), **ONEDNN_TOL)


def test_attention_metadata_slot_mapping():
    # seq 0: 3 cached + 2 new tokens in blocks [4, 7]; seq 1: a 1-token decode at position 4 in [2, 9]
    md = AttentionMetadata.build(
        query_lens=[2, 1], seq_lens=[5, 5], block_tables=[[4, 7], [2, 9]], block_size=4
    )
    assert md.query_start_loc == [0, 2, 3]
    # positions 3, 4 of seq 0 -> block 4 offset 3, block 7 offset 0; position 4 of seq 1 -> block 9 offset 0
    assert md.slot_mapping.tolist() == [4 * 4 + 3, 7 * 4 + 0, 9 * 4 + 0]
    assert md.block_tables.tolist() == [[4, 7], [2, 9]]


def test_accelerator_weights_are_not_chunked():
    """Chunking is a CPU-thread layout: on any other device a weight is one plain [in, out] block."""
    with torch.device("meta"):
        layer = Linear(16, [8, 8])
        emb = VocabEmbedding(12, 6)
    assert layer.weight.shape == (1, 16, 16)
    assert emb.weight_t.shape == (1, 6, 12)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M", [1, 5])
def test_gated_mlp_matches_reference(threads, kernel, bias, M):
    """Thread-sliced gate_up / down layout against the plain SwiGLU formula."""
    torch.manual_seed(0)
    H, inner = 8, 12  # 12 splits into 1, 2, 3 or 4 slices
    mlp = GatedMLP(H, inner, "silu", bias=bias)
    assert mlp.gate_up_proj.weight.shape[0] == threads
    gate, up, down = torch.randn(inner, H), torch.randn(inner, H), torch.randn(H, inner)
    mlp.gate_up_proj.load_shard("gate", gate, 0)
    mlp.gate_up_proj.load_shard("up", up, 1)
    mlp.down_proj.load_shard("down", down)
    bg, bu, bd = torch.randn(inner), torch.randn(inner), torch.randn(H)
    if bias:
        mlp.gate_up_proj.load_shard("gate.b", bg, 0, is_bias=True)
        mlp.gate_up_proj.load_shard("up.b", bu, 1, is_bias=True)
        mlp.down_proj.load_shard("down.b", bd, is_bias=True)
    else:
        bg, bu, bd = None, None, None
    with pytest.raises(WeightShapeError, match="gate"):
        mlp.gate_up_proj.load_shard("gate", torch.zeros(H, inner), 0)
    torch.testing.assert_close(mlp.gate_up_proj.logical_weight(), torch.cat([gate, up]))
    torch.testing.assert_close(mlp.down_proj.logical_weight(), down)
    if kernel == "onednn":
        mlp.gate_up_proj.use_onednn()
        mlp.down_proj.use_onednn()
    x = torch.randn(M, H)
    g, u = F.linear(x, gate, bg), F.linear(x, up, bu)
    torch.testing.assert_close(mlp.gate_up_proj(x), torch.cat([g, u], dim=-1), **ONEDNN_TOL)
    h = F.silu(g) * u
    torch.testing.assert_close(mlp.down_proj(h), F.linear(h, down, bd), **ONEDNN_TOL)
    torch.testing.assert_close(mlp(x), F.linear(h, down, bd), **ONEDNN_TOL)


def test_chunks_stay_wide_on_many_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(64)
    try:
        assert num_weight_chunks(576) == 9  # 64 columns each, not 64 chunks of 9
        assert num_weight_chunks(49152) == 64
        assert num_weight_chunks(100) == 1
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("M", [1, 7, 300])
def test_rms_norm_with_residual_fused_and_torch(monkeypatch, offset, M):
    """RMSNorm(x) and RMSNorm(x, residual) (add, then norm; the sum returned) on the fused CPU
    kernel and on torch's ops, against the formula."""
    torch.manual_seed(0)
    H = 48
    norm = RMSNorm(H, 1e-6, weight_offset=offset)
    norm.weight.data.copy_(torch.randn(H))
    x, residual = torch.randn(M, H), torch.randn(M, H)

    def ref(v: torch.Tensor) -> torch.Tensor:
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * (offset + norm.weight)

    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(layernorm, "cpu_fused", None)
        elif layernorm.cpu_fused is None:
            continue  # no numba here: the torch path is all there is
        torch.testing.assert_close(norm(x), ref(x))
        out, total = norm(x, residual.clone())
        torch.testing.assert_close(total, x + residual)
        torch.testing.assert_close(out, ref(x + residual))


def test_fused_norm_writes_the_sum_into_the_residual():
    if layernorm.cpu_fused is None:
        pytest.skip("numba is not importable here")
    norm = RMSNorm(16, 1e-6)
    norm.weight.data.fill_(1.0)
    x, residual = torch.randn(3, 16), torch.randn(3, 16)
    expected = x + residual
    _, total = norm(x, residual)
    assert total is residual  # in place: the model's own residual stream, no new buffer
    torch.testing.assert_close(residual, expected)


def test_norm_falls_back_to_torch_for_tensors_the_kernel_does_not_take():
    torch.manual_seed(0)
    norm = RMSNorm(16, 1e-6)
    norm.weight.data.copy_(torch.randn(16))
    x = torch.randn(4, 32)[:, :16]  # not contiguous
    torch.testing.assert_close(norm(x), F.rms_norm(x, (16,), norm.weight, 1e-6))
    norm.weight.data = norm.weight.data.bfloat16()  # a bfloat16 model
    xb = torch.randn(4, 16, dtype=torch.bfloat16)
    out, total = norm(xb, torch.zeros_like(xb))
    assert out.dtype == total.dtype == torch.bfloat16
    torch.testing.assert_close(total, xb)
