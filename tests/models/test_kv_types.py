"""K and V cache types apart (`kv_cache_dtype="int8,float16"`) end to end on a tiny model: the
block count follows K's and V's row bytes, the engine generates over a `KVPair` cache (eager and
through the fused CPU decoder), and `T,T` is the single type `T` to the bit."""

from __future__ import annotations

import pytest
import torch

from llmserve.config import ModelConfig
from llmserve.layers.attention import KVDtypes, KVPair
from llmserve.layers.attention.metadata import int8_row_size
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.model_loader import load_model
from tests.models.test_engine import GREEDY, PROMPTS, make_llm, reference, tiny, token_ids  # noqa: F401

BUDGET = 2**20


def test_int8_keys_float16_values_size_the_cache_by_both_rows(tiny, reference):  # noqa: F811
    fp32 = make_llm(tiny[0], num_kv_blocks=None, kv_cache_memory=BUDGET)
    mixed = make_llm(tiny[0], num_kv_blocks=None, kv_cache_memory=BUDGET, kv_cache_dtype="int8,float16")
    spec = fp32.engine.runner.runner.spec
    layers, H_kv, D = len(fp32.engine.runner.runner.kv_caches), spec.num_kv_heads, spec.head_dim
    info = mixed.engine.kv_info
    assert info.bytes_per_token == layers * H_kv * (int8_row_size(D) + 2 * D)
    assert info.num_blocks == BUDGET // (info.bytes_per_token * info.block_size)
    assert info.num_blocks > fp32.engine.kv_info.num_blocks
    assert info.dtype == "int8,float16" and info.summary().startswith("KV cache (int8,float16): ")
    cache = mixed.engine.runner.runner.kv_caches[0]
    assert isinstance(cache, KVPair) and (cache.k.dtype, cache.v.dtype) == (torch.int8, torch.float16)
    out = token_ids(mixed.generate(PROMPTS, GREEDY, use_tqdm=False))
    # int8 keys can move this random model's near-ties later on (test_engine.py, the int8 cache)
    assert [o[0] for o in out] == [r[0] for r in reference]
    assert [len(o) for o in out] == [len(r) for r in reference]


def test_16_bit_pair_runs_the_cpu_kernel_and_keeps_greedy_tokens(tiny, reference):  # noqa: F811
    llm = make_llm(tiny[0], kv_cache_dtype="f16,bf16")
    assert llm.engine.kv_info.dtype == "float16,bfloat16"
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference


@pytest.mark.parametrize("bad", ["float16,", "int4,float16", "int8,float16,float32"])
def test_bad_pairs_are_refused_naming_the_value(tiny, bad):  # noqa: F811
    with pytest.raises(ValueError, match=f"kv_cache_dtype must be .*got {bad!r}"):
        make_llm(tiny[0], kv_cache_dtype=bad)


def _logits(runner: ForwardRunner) -> torch.Tensor:
    """A prompt, then 3 decode steps: every step's logits."""
    seq, table = list(PROMPTS[1]), [7, 2, 9, 4, 0, 11, 5, 3]
    steps = [runner.execute([SequenceBatchEntry(seq, len(seq), table)], all_logits=True)]
    for _ in range(3):
        seq.append(int(steps[-1][-1].argmax()))
        steps.append(runner.execute([SequenceBatchEntry(seq[-1:], len(seq), table)]))
    return torch.cat(steps)


@pytest.mark.parametrize("quantization", ["none", "int8"])  # eager layers; the fused C++ decoder
def test_same_type_twice_is_the_single_type_to_the_bit(tiny, quantization):  # noqa: F811
    loaded = load_model(ModelConfig(model=str(tiny[0]), quantization=quantization, show_progress=False))
    for dtype in (torch.float16, torch.int8):
        one = ForwardRunner(loaded.model, num_blocks=12, block_size=4, kv_cache_dtype=dtype)
        two = ForwardRunner(loaded.model, num_blocks=12, block_size=4, kv_cache_dtype=KVDtypes(dtype, dtype))
        assert not isinstance(two.kv_caches[0], KVPair)
        assert (one.fused is None) == (two.fused is None) == (quantization == "none")
        assert torch.equal(_logits(one), _logits(two))
        assert all(torch.equal(a, b) for a, b in zip(one.kv_caches, two.kv_caches, strict=True))


@pytest.mark.parametrize(
    "kv",
    [KVDtypes(torch.int8, torch.float16), KVDtypes(torch.bfloat16, torch.int8), KVDtypes.of(torch.int8)],
)
def test_fused_decoder_runs_a_pair(tiny, kv):  # noqa: F811
    """Quantized weights on the CPU: the fused decoder takes K and V of their own types (and one
    int8 type, through the same code) and agrees with the layer-by-layer path over the same cache."""
    loaded = load_model(ModelConfig(model=str(tiny[0]), quantization="int8", show_progress=False))
    fused = ForwardRunner(loaded.model, num_blocks=12, block_size=4, kv_cache_dtype=kv)
    eager = ForwardRunner(loaded.model, num_blocks=12, block_size=4, kv_cache_dtype=kv)
    eager.use_fused(False)
    assert fused.fused is not None and eager.fused is None
    got, want = _logits(fused), _logits(eager)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().amax().item())
    # the fused decoder wrote each half in its own format, as the layers did
    for a, b in zip(fused.kv_caches, eager.kv_caches, strict=True):
        assert isinstance(a, KVPair) == kv.mixed and (a[0].dtype, a[1].dtype) == (kv.k, kv.v)
        half = 1 if kv.v != torch.int8 else 0  # a float half compares directly
        torch.testing.assert_close(a[half].float(), b[half].float(), rtol=2e-2, atol=2e-2)
