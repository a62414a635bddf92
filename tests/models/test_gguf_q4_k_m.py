"""A Q4_K_M-like GGUF read with fewer bytes and the same bits (issue 30):
- a fused layer whose shards come in different formats (Q4_K q and k beside a Q6_K v; here also
  a Q4_K gate beside a Q8_0 up) is kept as one matrix per format instead of one q8 matrix with
  minimums;
- Q4_K keeps its super-block d, dmin and 6-bit sub-scales (q4k) instead of a half scale and
  minimum per block of 32 (q4).
Today's representation is rebuilt from the loaded model the old way (`todays_weights`); greedy
tokens and logits equal it bit for bit, fused and layer by layer, with int16 and int8
activations, on each kernel set. The file's Q4_K blocks are random (d, dmin not powers of two),
so the sub-scales' rounding to half floats is at work."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from llmserve.config import ModelConfig
from llmserve.distributed.sharding import _columns
from llmserve.layers.quantization import QuantizedLinear, QuantizedVocabEmbedding, cpu_kernels, weight_groups
from llmserve.layers.quantization.formats import PackedWeight, pack, unpack
from llmserve.layers.quantization.layers import _concat, as_rows
from llmserve.model_executor.model_loader import load_model
from tests.gguf_writer import RANDOM_TYPES, tiny_llama_gguf
from tests.models.test_quantized import _decode_logits

pytestmark = pytest.mark.skipif(not cpu_kernels.has_native_kernels(), reason="needs llmserve's C++ kernels")

# Q4_K_M's mix (Q6_K as random valid blocks: gguf has no Q6_K quantizer), plus an up projection
# in Q8_0 so that gate_up splits too, and a tied Q4_K embedding (q4k row lookups and LM head).
Q4_K_M_TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K,
                "ffn_gate": Q.Q4_K, "ffn_up": Q.Q8_0, "ffn_down": Q.Q6_K, "token_embd": Q.Q4_K}  # fmt: skip

_ORDER = ["avx512_vnni", "avx2"]
NATIVE_SETS = _ORDER[_ORDER.index(cpu_kernels.best_kernels()) :] if cpu_kernels.has_native_kernels() else []


@pytest.fixture(scope="module")
def q4_k_m_gguf(tmp_path_factory):
    return tiny_llama_gguf(
        tmp_path_factory.mktemp("q4km"), Q4_K_M_TYPES, tokenizer=True, random_types=(*RANDOM_TYPES, Q.Q4_K)
    )


@pytest.fixture(params=NATIVE_SETS)
def kernels(request):
    cpu_kernels.set_kernels(request.param)
    yield request.param
    cpu_kernels.set_kernels("auto")


def _as_q4(w: PackedWeight) -> PackedWeight:
    return pack(unpack(w).as_q4())


def todays_weights(model: torch.nn.Module) -> int:
    """The model's weights as llmserve held them before the split and q4k: each split layer's
    4- and 8-bit shards widened to q8 and concatenated into one matrix (minimums stored for all),
    q4k matrices as q4 (half scale and minimum per block). A Q6_K shard stays the q6 matrix of its
    own it is since Q6_K is read as q6 (the file's values, not today's bits to keep). Returns how
    many layers it rebuilt."""
    count = 0
    for m in model.modules():
        if isinstance(m, QuantizedLinear) and m.qweight is None:
            rows = [unpack(p).as_q4() for p in m.parts]
            wide = [r for r in rows if r.fmt != "q6"]
            q8 = pack(_concat([as_rows("w", r, "q8", (r.num_rows, r.in_features)) for r in wide]))
            assert all(r.fmt != "q6" for r in rows[: len(wide)])  # q6 shards come last here (v)
            packed = [q8, *(pack(r) for r in rows[len(wide) :])]
            m.qweight, m.parts = (packed[0], []) if len(packed) == 1 else (None, packed)
            count += 1
        elif isinstance(m, QuantizedLinear | QuantizedVocabEmbedding) and m.qweight.fmt == "q4k":
            m.qweight = _as_q4(m.qweight)
            count += 1
    return count


def _bytes(model: torch.nn.Module) -> int:
    return sum(g.num_bytes for g in weight_groups(model) if g.fmt in ("q4", "q4k", "q8"))


@pytest.mark.parametrize("cpu_activations", ["int16", "int8"])
def test_q4_k_m_gives_todays_bits(q4_k_m_gguf, kernels, cpu_activations):
    """Greedy tokens and logits (prefill, then decode steps of three sequences) equal those of
    today's representation bit for bit, fused and layer by layer."""
    config = ModelConfig(model=str(q4_k_m_gguf), cpu_activations=cpu_activations, show_progress=False)
    new, old = load_model(config).model, load_model(config).model
    layer = new.model.layers[0]
    assert [p.fmt for p in layer.self_attn.qkv_proj.parts] == ["q4k", "q6"]  # [q | k] Q4_K, v Q6_K
    assert [p.fmt for p in layer.mlp.gate_up_proj.parts] == ["q4k", "q8"]
    assert layer.self_attn.o_proj.qweight.fmt == new.model.embed_tokens.qweight.fmt == "q4k"
    assert "q4k+q6" in repr(layer.self_attn.qkv_proj)
    assert todays_weights(old) == 2 * 3 + 1  # per layer qkv, o, gate_up; the tied embedding
    assert _bytes(new) < _bytes(old)
    for fused in (True, False):
        got, want = _decode_logits(new, fused), _decode_logits(old, fused)
        assert torch.isfinite(want).all() and want.abs().amax() > 0
        assert torch.equal(got, want), f"fused={fused}"
    qkv_new, qkv_old = new.model.layers[1].self_attn.qkv_proj, old.model.layers[1].self_attn.qkv_proj
    assert torch.equal(qkv_new.logical_weight(), qkv_old.logical_weight())


def test_torch_path_matches(q4_k_m_gguf):
    """Without the C++ kernels a split layer multiplies by its matrices' rows stacked again, and
    q4k rows dequantize to q4's values."""
    config = ModelConfig(model=str(q4_k_m_gguf), show_progress=False)
    model = load_model(config).model
    qkv, embed = model.model.layers[0].self_attn.qkv_proj, model.model.embed_tokens
    x = torch.randn(3, qkv.in_features, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([0, 17, 511])
    native = embed(ids)
    cpu_kernels.set_kernels("torch")
    try:
        got, rows = qkv(x), embed(ids)
    finally:
        cpu_kernels.set_kernels("auto")
    torch.testing.assert_close(got, x @ qkv.logical_weight().T, rtol=1e-5, atol=1e-5)
    assert torch.equal(rows, native)
    assert torch.equal(rows, unpack(_as_q4(embed.qweight)).select_rows(ids).dequantize())


def test_explicit_method_widens(q4_k_m_gguf):
    """Only `auto` keeps a GGUF file's formats shard by shard; an explicit method's layer is one
    matrix in its format."""
    model = load_model(ModelConfig(model=str(q4_k_m_gguf), quantization="int8", show_progress=False)).model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.parts == [] and qkv.qweight is not None and qkv.qweight.fmt == "q8"


def test_row_parallel_shards_keep_whole_super_blocks(q4_k_m_gguf):
    """A row-parallel shard of q4k rows stays q4k on whole super-blocks of 256 input columns and
    falls back to q4 (the same values) otherwise; both equal today's q4 rows cut the same way."""
    from llmserve.model_executor.model_loader.gguf_loader import GGUFCheckpoint

    weights = GGUFCheckpoint([q4_k_m_gguf]).iter_weights(torch.float32, keep_quantized=lambda n: True)
    rows = next(t for n, t, _ in weights if n.endswith("gate_proj.weight"))  # [512, 256]: one super-block
    wide = type(rows)(
        "q4k",
        rows.q.repeat(1, 4),
        rows.d.repeat(1, 4),
        rows.m.repeat(1, 4),
        1024,
        rows.scales.repeat(1, 4, 1),
    )
    for t, start, n, fmt in ((wide, 512, 512, "q4k"), (wide, 256, 256, "q4k"), (rows, 128, 128, "q4")):
        cut = _columns("w", t, start, n)
        want = _columns("w", t.as_q4(), start, n)
        assert cut.fmt == fmt
        assert torch.equal(cut.dequantize(), want.dequantize())
        assert torch.equal(pack(cut.as_q4()).d, pack(want).d)


@pytest.mark.slow
def test_tp2_matches_tp1(q4_k_m_gguf):
    """TP=2 over the file (down_proj's 256 input columns per rank stay q4k, o_proj's 128 fall
    back to q4): greedy tokens equal TP=1's."""
    from tests.models.test_tensor_parallel import compare_tp

    compare_tp(str(q4_k_m_gguf), atol=2e-3)


def test_a_q4k_only_file_takes_the_16_bit_kv_cache(tmp_path):
    """The CPU kernels' formats take a float16 KV cache by default: q4k too, where it is the only one."""
    only_q4k = {name: Q.Q4_K for name in (*Q4_K_M_TYPES, "output")}
    path = tiny_llama_gguf(tmp_path, only_q4k, tokenizer=True, random_types=(*RANDOM_TYPES, Q.Q4_K))
    loaded = load_model(ModelConfig(model=str(path), show_progress=False))
    assert {g.fmt for g in loaded.weight_groups if g.role != "other"} <= {"q4k", "float32"}
    assert loaded.kv_cache_dtype().k == torch.float16
