"""Granite MoE beyond the shared parity tables (tiny.py's "granite-moe", checkpoints saved by
transformers 5): the original checkpoints' tensor names, and llama.cpp's `granitemoe` GGUF files
(the experts' gate-and-up tensor split in two by the converter), against transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from llmserve.config import ModelConfig
from llmserve.layers.quantization.layers import QuantizedLinear
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.model_loader import load_model
from tests.gguf_writer import convert_state_dict, hf_metadata, with_placeholder_tokenizer, write_gguf
from tests.models.tiny import make_tiny_model

PROMPT = [5, 17, 99, 3, 200, 1, 1, 45, 67, 30, 12, 9, 8, 7, 6, 5, 4, 3, 2, 11]
TOL = 3e-2  # int16 activations against float (test_quantized.py's)


@pytest.fixture(scope="module")
def granite_moe(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("granite-moe")
    return make_tiny_model("granite-moe", folder), folder


def _logits(loaded) -> torch.Tensor:
    entry = [SequenceBatchEntry(PROMPT, len(PROMPT), list(range(5)))]
    return ForwardRunner(loaded.model, num_blocks=8, block_size=4).execute(entry, all_logits=True)


def _reference(hf) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([PROMPT])).logits[0]


def test_original_checkpoint_names(granite_moe, tmp_path: Path) -> None:
    """IBM's checkpoints name the experts `input_linear` / `output_linear` and the router
    `router.layer` (transformers 5 renames them on load): the same model either way."""
    hf, folder = granite_moe
    state = load_file(folder / "model.safetensors")
    renamed = {}
    for name, t in state.items():
        name = name.replace(".block_sparse_moe.experts.gate_up_proj", ".block_sparse_moe.input_linear.weight")
        name = name.replace(".block_sparse_moe.experts.down_proj", ".block_sparse_moe.output_linear.weight")
        name = name.replace(".block_sparse_moe.router.weight", ".block_sparse_moe.router.layer.weight")
        renamed[name] = t
    assert any("input_linear" in n for n in renamed) and any("router.layer" in n for n in renamed)
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(renamed, tmp_path / "model.safetensors")
    got = _logits(load_model(ModelConfig(model=str(tmp_path), show_progress=False)))
    torch.testing.assert_close(got, _reference(hf), rtol=1e-4, atol=1e-4)


def _granitemoe_gguf(hf, path: Path, qtype: Q) -> Path:
    """The tiny Granite MoE as llama.cpp's GraniteMoeModel converts it: Llama's tensors (q / k
    permuted), the router as ffn_gate_inp, the stacked gate-and-up split into ffn_gate_exps and
    ffn_up_exps, down as ffn_down_exps; matrices in `qtype`."""
    config = hf.config
    state = {n: t for n, t in hf.state_dict().items() if ".block_sparse_moe." not in n}
    tensors: dict = dict(convert_state_dict("granite", config, state))
    inter = config.intermediate_size
    for i in range(config.num_hidden_layers):
        moe = f"model.layers.{i}.block_sparse_moe."
        gate_up = hf.state_dict()[moe + "experts.gate_up_proj"].float().numpy()
        tensors[f"blk.{i}.ffn_gate_inp.weight"] = hf.state_dict()[moe + "router.weight"].float().numpy()
        tensors[f"blk.{i}.ffn_gate_exps.weight"] = np.ascontiguousarray(gate_up[:, :inter])
        tensors[f"blk.{i}.ffn_up_exps.weight"] = np.ascontiguousarray(gate_up[:, inter:])
        tensors[f"blk.{i}.ffn_down_exps.weight"] = hf.state_dict()[moe + "experts.down_proj"].float().numpy()
    if qtype != Q.F32:
        tensors = {
            n: (a, qtype) if a.ndim >= 2 and "ffn_gate_inp" not in n and "token_embd" not in n else a
            for n, a in tensors.items()
        }
    metadata = with_placeholder_tokenizer(hf_metadata("granite", config), config.vocab_size)
    return write_gguf(path, "granitemoe", tensors, metadata)[0]


def test_gguf_matches_transformers(granite_moe, tmp_path: Path) -> None:
    hf, _ = granite_moe
    path = _granitemoe_gguf(hf, tmp_path / "f32.gguf", Q.F32)
    loaded = load_model(ModelConfig(model=str(path), show_progress=False))
    assert type(loaded.model).__name__ == "GraniteMoeForCausalLM"
    torch.testing.assert_close(_logits(loaded), _reference(hf), rtol=1e-4, atol=1e-4)


def test_gguf_experts_stay_in_their_blocks(granite_moe, tmp_path: Path) -> None:
    hf, _ = granite_moe
    path = _granitemoe_gguf(hf, tmp_path / "q8.gguf", Q.Q8_0)
    quant = load_model(ModelConfig(model=str(path), cpu_activations="int16", show_progress=False))
    plain = load_model(ModelConfig(model=str(path), quantization="none", show_progress=False))
    expert = quant.model.model.layers[1].mlp.experts[3].gate_up_proj
    assert isinstance(expert, QuantizedLinear) and expert.fmt == "q8"
    torch.testing.assert_close(_logits(quant), _logits(plain), rtol=TOL, atol=TOL)
