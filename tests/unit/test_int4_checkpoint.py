"""GPTQ / AWQ tensors (layers/quantization/int4_checkpoint.py) against packers written from the
formats' rules (tests/models/prequant_writer.py): unpacking, the q4 / q8 rows and how exact they
are, act-order's permutation in `QuantizedLinear`, and `quantization_config` parsing."""

from __future__ import annotations

import pytest
import torch

from llmserve.layers.quantization import QuantizedLinear, cpu_kernels
from llmserve.layers.quantization.formats import PermutedRows
from llmserve.layers.quantization.int4_checkpoint import awq_groups, gptq_groups
from llmserve.load_errors import ModelLoadError, WeightShapeError
from llmserve.model_executor.model_loader.hf_quant_config import read_checkpoint_quantization
from llmserve.model_executor.model_loader.prequantized import PrequantizedCheckpoint
from tests.models.prequant_writer import awq, gptq

N, K = 48, 256


def _w(seed: int = 0) -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05


def _gptq(group_size=128, sym=True, act_order=False, v1=True):
    order = torch.randperm(K, generator=torch.Generator().manual_seed(1)) if act_order else None
    t, deq = gptq(_w(), group_size, sym, order, v1)
    groups = gptq_groups("l", t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group_size, 1 if v1 else 0)
    return groups, deq


def _in_natural_order(rows) -> torch.Tensor:
    if isinstance(rows, PermutedRows):
        w = torch.empty(N, K)
        w[:, rows.perm] = rows.rows.dequantize()
        return w
    return rows.dequantize()


@pytest.mark.parametrize("v1", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_gptq_reads_the_formats_values(group_size, sym, act_order, v1):
    groups, deq = _gptq(group_size, sym, act_order, v1)
    assert torch.equal(groups.dequantize(), deq)  # the format's formula, exactly
    permuted = act_order and group_size != -1  # one group per row: any order is grouped
    assert groups.act_order == permuted
    rows = groups.to_rows("q4")
    assert isinstance(rows, PermutedRows) == permuted
    q4 = _in_natural_order(rows)
    if sym:  # zero 8: symmetric q4 blocks, -8 d computed from the half scale: the same values
        assert (rows.rows if permuted else rows).m is None
        assert torch.equal(q4, deq)
    else:  # m = -z d rounded to a half float: at most 2^-11 |z d| <= d / 128 off
        step = groups.scales[groups.g_idx].T.float()
        assert ((q4 - deq).abs() <= step / 128).all() and not torch.equal(q4, deq)
    assert torch.equal(_in_natural_order(groups.to_rows("q8")), deq)  # q - z in int8: exact


def test_gptq_v1_zero_of_zero_reads_as_sixteen():
    """v1 stores z - 1; a zero of 0 is stored as 15 and read back as 16 (AutoGPTQ's kernels)."""
    t, deq = gptq(_w().abs() + 0.01, 128, False, None, v1=True)  # all positive: z = 0
    groups = gptq_groups("l", t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 128, 1)
    assert (groups.zeros == 16).all() and torch.equal(groups.dequantize(), deq)


@pytest.mark.parametrize("group_size", [32, 128])
def test_awq_reads_the_interleaved_order(group_size):
    t, deq = awq(_w(), group_size)
    groups = awq_groups("l", t["qweight"], t["qzeros"], t["scales"], group_size)
    assert torch.equal(groups.dequantize(), deq)
    # Read as GPTQ-ordered nibbles, the columns would be shuffled within each 8
    assert not torch.equal(groups.q, groups.q.view(N // 8, 8, K)[:, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(N, K))
    assert torch.equal(_in_natural_order(groups.to_rows("q8")), deq)


@pytest.mark.skipif(cpu_kernels.kernels() == "torch", reason="needs a kernel set")
def test_act_order_layer_gathers_its_input():
    groups, deq = _gptq(128, True, act_order=True)
    layer = QuantizedLinear(K, [N], bias=False, fmt="q4")
    layer.load_shard("l.weight", groups.to_rows("q4"))
    assert layer.input_perm is not None and torch.equal(layer.logical_weight(), deq)
    x = torch.randn(5, K)
    torch.testing.assert_close(layer(x), x @ deq.T, rtol=1e-3, atol=1e-3)
    plain = QuantizedLinear(K, [N], bias=False, fmt="q4")
    plain.load_shard("l.weight", groups.to_rows("q4").rows)  # the same rows without the gather
    assert (plain(x) - x @ deq.T).abs().max() > 0.1


def test_fused_shards_must_share_their_permutation():
    a, _ = _gptq(128, True, act_order=True)
    t, _ = gptq(_w(1), 128, True, torch.randperm(K, generator=torch.Generator().manual_seed(9)), True)
    b = gptq_groups("k", t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 128, 1)
    layer = QuantizedLinear(K, [N, N], bias=False, fmt="q4")
    layer.load_shard("q.weight", a.to_rows("q4"), 0)
    with pytest.raises(ValueError, match="different act-order permutations"):
        layer.load_shard("k.weight", b.to_rows("q4"), 1)


def test_bad_tensors_are_named():
    t, _ = gptq(_w(), 128, True, None, True)
    with pytest.raises(WeightShapeError, match="l.qzeros"):
        gptq_groups("l", t["qweight"], t["qzeros"][:, :2], t["scales"], t["g_idx"], 128, 1)
    with pytest.raises(ModelLoadError, match=r"l.g_idx: group indices must lie in 0..1"):
        gptq_groups("l", t["qweight"], t["qzeros"], t["scales"], t["g_idx"] * 4, 128, 1)
    with pytest.raises(ModelLoadError, match="l.qweight: dtype torch.float32"):
        gptq_groups("l", t["qweight"].float(), t["qzeros"], t["scales"], t["g_idx"], 128, 1)


class _Config:
    def __init__(self, qc: dict) -> None:
        self.quantization_config = qc


@pytest.mark.parametrize(
    ("qc", "message"),
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits 8"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size 100"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version 'gemv'"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point False"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, r"weight_block_size \[128, 128\]"),
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {}}},
            "format.*'pack-quantized'",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "block"}}},
            },
            "strategy",
        ),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(qc, message):
    with pytest.raises(ValueError, match=message):
        read_checkpoint_quantization(_Config(qc))


def test_config_fields_are_read():
    q = read_checkpoint_quantization(
        _Config({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": False})
    )
    assert (q.group_size, q.desc_act, q.sym, q.zero_offset) == (64, True, False, 1)
    assert q.describe() == "gptq (4-bit, group 64, act-order, asymmetric)"
    v2 = read_checkpoint_quantization(
        _Config({"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq_v2"})
    )
    assert v2.zero_offset == 0 and v2.group_size == 128
    assert read_checkpoint_quantization(_Config(None)) is None


def test_scan_names_a_missing_tensor():
    quant = read_checkpoint_quantization(_Config({"quant_method": "gptq", "bits": 4}))
    dtypes = {
        "a.q_proj.qweight": "I32",
        "a.q_proj.qzeros": "I32",
        "a.q_proj.g_idx": "I32",
        "a.norm.weight": "F16",
    }
    with pytest.raises(ModelLoadError, match="lacks tensor a.q_proj.scales"):
        PrequantizedCheckpoint.scan(quant, dtypes)
    ok = PrequantizedCheckpoint.scan(quant, {**dtypes, "a.q_proj.scales": "F16", "a.q_proj.bias": "F16"})
    assert ok.layers == {"a.q_proj": frozenset({"qweight", "qzeros", "scales", "g_idx"})}
