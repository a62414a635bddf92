"""A fused layer whose GGUF shards come in different formats (Q4_K_M: Q4_K q and k beside a Q6_K
v; here also a Q4_K gate beside a Q8_0 up) is kept as one matrix per format instead of one q8
matrix with minimums: fewer bytes a step, and the same bits as the widened matrix, on the fused
decoder and the layer path, with int16 and int8 activations, on each kernel set."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from llmserve.config import ModelConfig
from llmserve.layers.quantization import QuantizedLinear, cpu_kernels, weight_groups
from llmserve.layers.quantization.formats import pack, unpack
from llmserve.layers.quantization.layers import _concat, as_rows
from llmserve.model_executor.model_loader import load_model
from tests.gguf_writer import tiny_llama_gguf
from tests.models.test_quantized import _decode_logits

pytestmark = pytest.mark.skipif(not cpu_kernels.has_native_kernels(), reason="needs llmserve's C++ kernels")

# Q4_K_M's mix (Q6_K is random valid blocks: gguf has no Q6_K quantizer), plus an up projection
# in Q8_0 so that gate_up splits too.
Q4_K_M_TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K,
                "ffn_gate": Q.Q4_K, "ffn_up": Q.Q8_0, "ffn_down": Q.Q6_K, "token_embd": Q.Q8_0}  # fmt: skip

_ORDER = ["avx512_vnni", "avx2"]
NATIVE_SETS = _ORDER[_ORDER.index(cpu_kernels.best_kernels()) :] if cpu_kernels.has_native_kernels() else []


@pytest.fixture(scope="module")
def q4_k_m_gguf(tmp_path_factory):
    return tiny_llama_gguf(tmp_path_factory.mktemp("q4km"), Q4_K_M_TYPES)


@pytest.fixture(params=NATIVE_SETS)
def kernels(request):
    cpu_kernels.set_kernels(request.param)
    yield request.param
    cpu_kernels.set_kernels("auto")


def _widen_split_layers(model: torch.nn.Module) -> int:
    """Today's representation, built the old way: each split layer's shards widened to q8 and
    concatenated into one matrix (minimums stored for all). Returns how many layers it rebuilt."""
    count = 0
    for m in model.modules():
        if isinstance(m, QuantizedLinear) and m.qweight is None:
            rows = [unpack(p) for p in m.parts]
            m.qweight = pack(_concat([as_rows("w", r, "q8", (r.num_rows, r.in_features)) for r in rows]))
            m.parts = []
            count += 1
    return count


def _bytes(model: torch.nn.Module) -> int:
    return sum(g.num_bytes for g in weight_groups(model) if g.fmt in ("q4", "q8"))


@pytest.mark.parametrize("cpu_activations", ["int16", "int8"])
def test_split_layers_give_todays_bits(q4_k_m_gguf, kernels, cpu_activations):
    """Greedy tokens and logits (prefill, then decode steps of three sequences) of the split
    layers equal the widened q8 matrices' bit for bit, fused and layer by layer."""
    config = ModelConfig(model=str(q4_k_m_gguf), cpu_activations=cpu_activations, show_progress=False)
    split, old = load_model(config).model, load_model(config).model
    layer = split.model.layers[0]
    assert [p.fmt for p in layer.self_attn.qkv_proj.parts] == ["q4", "q8"]  # [q | k] Q4_K, v Q6_K
    assert [p.fmt for p in layer.mlp.gate_up_proj.parts] == ["q4", "q8"]
    assert layer.self_attn.o_proj.qweight is not None and layer.self_attn.o_proj.qweight.fmt == "q4"
    assert "q4+q8" in repr(layer.self_attn.qkv_proj)
    assert _widen_split_layers(old) == 4  # qkv and gate_up of both layers
    assert _bytes(split) < _bytes(old)
    for fused in (True, False):
        got, want = _decode_logits(split, fused), _decode_logits(old, fused)
        assert torch.isfinite(want).all() and want.abs().amax() > 0
        assert torch.equal(got, want), f"fused={fused}"
    qkv_split, qkv_old = split.model.layers[1].self_attn.qkv_proj, old.model.layers[1].self_attn.qkv_proj
    assert torch.equal(qkv_split.logical_weight(), qkv_old.logical_weight())


def test_split_layer_on_the_torch_path_matches(q4_k_m_gguf):
    """Without the C++ kernels the split layer multiplies by its matrices' rows stacked again."""
    config = ModelConfig(model=str(q4_k_m_gguf), show_progress=False)
    qkv = load_model(config).model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(3, qkv.in_features, generator=torch.Generator().manual_seed(1))
    cpu_kernels.set_kernels("torch")
    try:
        got = qkv(x)
    finally:
        cpu_kernels.set_kernels("auto")
    torch.testing.assert_close(got, x @ qkv.logical_weight().T, rtol=1e-5, atol=1e-5)


def test_int4_method_still_widens(q4_k_m_gguf):
    """Only `auto` keeps a GGUF file's formats shard by shard; an explicit method's layer is one
    matrix in its format."""
    model = load_model(ModelConfig(model=str(q4_k_m_gguf), quantization="int8", show_progress=False)).model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.parts == [] and qkv.qweight is not None and qkv.qweight.fmt == "q8"
