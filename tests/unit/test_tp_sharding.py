"""Tensor-parallel sharding without processes: how checkpoint tensors are cut (float and q8/q4
blocks), the per-rank config, and the options that turn it on."""

from __future__ import annotations

import pytest
import torch
import transformers

from llmserve.cli.engine_args import llm_kwargs
from llmserve.cli.main import build_parser
from llmserve.config.engine_args import EngineArgs
from llmserve.config.parallel import ParallelConfig
from llmserve.distributed.sharding import (
    TPShard,
    _columns,
    _rows,
    _stacked_experts,
    check_supported,
    local_config,
    shard_lora_pair,
)
from llmserve.layers.quantization.formats import quantize
from llmserve.models.gpt2 import GPT2LMHeadModel
from llmserve.models.gpt_oss import split_experts
from llmserve.models.llama import LlamaForCausalLM
from llmserve.models.qwen_moe import Qwen3MoeForCausalLM


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_row_parallel_split_keeps_whole_blocks(fmt):
    """Each rank's input columns of a quantized [out, in] weight dequantize to exactly that
    slice of the full weight (same blocks, same scales: no requantization)."""
    torch.manual_seed(0)
    w = quantize(torch.randn(48, 256), fmt)
    full = w.dequantize()
    for rank in range(4):
        part = _columns("o_proj.weight", w, rank * 64, 64)
        assert part.in_features == 64
        torch.testing.assert_close(part.dequantize(), full[:, rank * 64 : rank * 64 + 64], rtol=0, atol=0)


def test_row_parallel_split_refuses_partial_blocks():
    w = quantize(torch.randn(8, 96), "q4")
    with pytest.raises(ValueError, match="does not fall on whole blocks of 32"):
        _columns("model.layers.0.mlp.down_proj.weight", w, 48, 48)


@pytest.mark.parametrize("quantized", [False, True])
def test_vocabulary_rows_padded_with_zeros(quantized):
    """A vocabulary of 10 over 3 ranks: 4 rows each, the last rank's 2 past the end are zero."""
    torch.manual_seed(0)
    table = torch.randn(10, 32)
    t = quantize(table, "q8") if quantized else table
    parts = [_rows(t, r * 4, 4) for r in range(3)]
    rows = [p.dequantize() if quantized else p for p in parts]
    expected = t.dequantize() if quantized else table
    torch.testing.assert_close(torch.cat(rows)[:10], expected, rtol=0, atol=0)
    assert torch.count_nonzero(rows[2][2:]) == 0


def test_local_config():
    config = transformers.Qwen3Config(
        vocab_size=513, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=128, num_hidden_layers=1,
    )  # fmt: skip
    local = local_config(config, 2)
    assert (local.num_attention_heads, local.num_key_value_heads, local.head_dim) == (2, 1, 32)
    assert (local.intermediate_size, local.vocab_size, local.hidden_size) == (64, 257, 64)
    assert config.num_attention_heads == 4  # the model's own config is left alone
    llama = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4)
    assert local_config(llama, 4).head_dim == 16  # hidden / heads of the whole model


def test_check_supported():
    config = transformers.LlamaConfig(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=96
    )
    check_supported(LlamaForCausalLM, config, 2)
    with pytest.raises(ValueError, match=r"does not divide the model's num_attention_heads \(6\)"):
        check_supported(LlamaForCausalLM, config, 4)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\)"):
        check_supported(LlamaForCausalLM, config, 3)
    with pytest.raises(ValueError, match="does not support the GPT2LMHeadModel architecture"):
        check_supported(GPT2LMHeadModel, config, 2)
    moe = transformers.Qwen2MoeConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
        moe_intermediate_size=48, shared_expert_intermediate_size=90,
    )  # fmt: skip
    check_supported(Qwen3MoeForCausalLM, moe, 2)
    with pytest.raises(
        ValueError, match=r"does not divide the model's shared_expert_intermediate_size \(90\)"
    ):
        check_supported(Qwen3MoeForCausalLM, moe, 4)


def test_local_config_of_moe_models():
    """The expert and shared-expert widths split with the dense one; the experts stay whole in
    number (every rank holds a slice of each)."""
    config = transformers.Qwen2MoeConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, num_experts=8,
        moe_intermediate_size=64, shared_expert_intermediate_size=96,
    )  # fmt: skip
    local = local_config(config, 2)
    assert (local.intermediate_size, local.moe_intermediate_size, local.shared_expert_intermediate_size) == (
        64,
        32,
        48,
    )
    assert local.num_experts == 8
    mixtral = local_config(transformers.MixtralConfig(intermediate_size=256, num_local_experts=4), 4)
    assert (mixtral.intermediate_size, mixtral.num_local_experts) == (64, 4)
    assert not hasattr(mixtral, "moe_intermediate_size")  # a width the model lacks is not made up


def test_lora_pairs_cut_as_punica_shards_them():
    """B of a column-parallel layer on its output rows, A of a row-parallel one on its input
    columns; other layers whole; a size that does not split is a ValueError naming it."""
    a, b = torch.randn(8, 64), torch.randn(96, 8)  # A [r, in], B [out, r]
    shard = TPShard(1, 2)
    got_a, got_b = shard_lora_pair("model.layers.0.self_attn.qkv_proj", a, b, shard, "x")
    assert got_a is a and torch.equal(got_b, b[48:])
    got_a, got_b = shard_lora_pair("model.layers.0.mlp.experts.3.down_proj", a, b, shard, "x")
    assert torch.equal(got_a, a[:, 32:]) and got_b is b
    assert shard_lora_pair("model.layers.0.mlp.gate", a, b, shard, "x") == (a, b)
    with pytest.raises(ValueError, match=r"f: lora_B's rows \(96\) do not split into 5"):
        shard_lora_pair("model.layers.0.mlp.gate_up_proj", a, b, TPShard(0, 5), "f")


@pytest.mark.parametrize("kind", ["", "_bias"])
@pytest.mark.parametrize("proj", ["gate_up_proj", "down_proj"])
def test_gpt_oss_stacked_experts_cut_before_the_split(proj, kind):
    """Cutting gpt-oss's stacked (gate/up interleaved) tensors and then splitting them per expert
    gives each expert's rank rows / columns, as cutting the per-expert tensors would; the down
    bias is rank 0's alone."""
    experts, hidden, inter, size = 3, 8, 12, 2
    shapes = {("gate_up_proj", ""): (experts, hidden, 2 * inter), ("gate_up_proj", "_bias"): (experts, 2 * inter),
              ("down_proj", ""): (experts, inter, hidden), ("down_proj", "_bias"): (experts, hidden)}  # fmt: skip
    name = f"model.layers.0.mlp.experts.{proj}{kind}"
    t = torch.randn(shapes[(proj, kind)])
    full = {n: x for n, x, _ in split_experts([(name, t, "f")])}
    n = inter // size
    for rank in range(size):
        cut = _stacked_experts(proj, kind, t, TPShard(rank, size))
        for part_name, part in ((n_, x) for n_, x, _ in split_experts([(name, cut, "f")])):
            whole = full[part_name]
            if proj == "down_proj" and kind == "_bias":
                want = whole if rank == 0 else torch.zeros_like(whole)
            elif proj == "down_proj":  # [H, I]: the rank's input columns
                want = whole[:, rank * n : (rank + 1) * n]
            else:  # gate or up rows (bias entries) of the rank's units
                want = whole[rank * n : (rank + 1) * n]
            assert torch.equal(part, want), part_name


def test_parallel_options():
    args = EngineArgs.from_options({"tensor_parallel_size": "2", "threads_per_rank": "1"}, "LLM")
    assert args.parallel_config() == ParallelConfig(2, "mp", 1)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1; got 0"):
        EngineArgs.from_options({"tensor_parallel_size": 0}, "LLM")
    options = {"tensor_parallel_size": "2", "distributed_executor_backend": "ray"}
    assert EngineArgs.from_options(options, "LLM").parallel_config() == ParallelConfig(2, "ray")
    with pytest.raises(ValueError, match="distributed_executor_backend must be 'mp' or 'ray'"):
        ParallelConfig(2, "slurm")  # type: ignore[arg-type]
    options = {**options, "ray_placement_strategy": "STRICT_SPREAD"}
    assert EngineArgs.from_options(options, "LLM").parallel_config() == ParallelConfig(
        2, "ray", None, "STRICT_SPREAD"
    )
    with pytest.raises(
        ValueError,
        match="ray_placement_strategy must be one of PACK, STRICT_PACK, SPREAD, STRICT_SPREAD; got 'spread'",
    ):
        EngineArgs.from_options({**options, "ray_placement_strategy": "spread"}, "LLM")
    cli = build_parser().parse_args(["generate", "--ray-placement-strategy", "STRICT_SPREAD", "hi"])
    assert llm_kwargs(cli)["ray_placement_strategy"] == "STRICT_SPREAD"
    cli = build_parser().parse_args(
        ["generate", "--tensor-parallel-size", "2", "--threads-per-rank", "1", "hi"]
    )
    kwargs = llm_kwargs(cli)
    assert (kwargs["tensor_parallel_size"], kwargs["distributed_executor_backend"], kwargs["threads_per_rank"]) == (
        2, "mp", 1,
    )  # fmt: skip


def test_safetensors_slices_read_only_the_shard(tmp_path):
    """A safetensors slice is cut before it is read: the same rows / columns as the tensor's."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    torch.manual_seed(0)
    w = torch.randn(10, 64)
    save_file({"w": w}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as sf:
        lazy = sf.get_slice("w")
        for r in range(3):  # rows, the last rank's tail padded
            torch.testing.assert_close(_rows(lazy, r * 4, 4), _rows(w, r * 4, 4), rtol=0, atol=0)
        torch.testing.assert_close(_columns("w", lazy, 32, 32), w[:, 32:], rtol=0, atol=0)
