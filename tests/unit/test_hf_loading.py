"""Loading HF model folders: safetensors (single and sharded), the safe `.bin` path, and every
loading error a user can meet, each naming the file, the tensor and what was expected."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve.config import ModelConfig
from llmserve.layers import onednn
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.model_loader import load_model
from llmserve.model_executor.model_loader.errors import (
    MissingWeightsError,
    ModelLoadError,
    ModelNotFoundError,
    UnexpectedWeightError,
    UnsafeCheckpointError,
    UnsupportedArchitectureError,
    WeightShapeError,
)
from tests.models.tiny import make_tiny_model

PROMPT = [3, 14, 15, 92, 65, 35]


def _load(folder: Path, **kw) -> object:
    return load_model(ModelConfig(model=str(folder), show_progress=False, **kw))


def _logits(loaded) -> torch.Tensor:
    runner = ForwardRunner(loaded.model, num_blocks=4, block_size=4)
    return runner.execute([SequenceBatchEntry(PROMPT, len(PROMPT), [0, 1])], all_logits=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    folder = tmp_path_factory.mktemp("llama")
    hf = make_tiny_model("llama", folder)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    return folder, ref


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_loaded_model_reports_what_it_loaded(tiny):
    folder, _ = tiny
    loaded = _load(folder)
    state = load_file(str(folder / "model.safetensors"))
    assert loaded.num_params == sum(t.numel() for t in state.values())
    assert loaded.weight_bytes == 4 * loaded.num_params
    assert loaded.dtype == torch.float32 and loaded.checkpoint_format == "safetensors"
    assert loaded.load_seconds > 0
    assert "LlamaForCausalLM" in loaded.summary()


def test_sharded_safetensors_with_index(tiny, tmp_path):
    folder, ref = tiny
    state = load_file(str(folder / "model.safetensors"))
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    out = tmp_path / "sharded"
    out.mkdir()
    (out / "config.json").write_bytes((folder / "config.json").read_bytes())
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(out / fname))
        weight_map.update(dict.fromkeys(keys, fname))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    torch.testing.assert_close(_logits(_load(out)), ref, rtol=1e-4, atol=1e-4)

    (out / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="model-00002-of-00002.safetensors"):
        _load(out)


def test_pytorch_bin_loads_through_weights_only(tiny, tmp_path):
    folder, ref = tiny
    out = tmp_path / "bin"
    out.mkdir()
    (out / "config.json").write_bytes((folder / "config.json").read_bytes())
    torch.save(load_file(str(folder / "model.safetensors")), out / "pytorch_model.bin")
    loaded = _load(out)
    assert loaded.checkpoint_format == "bin"
    torch.testing.assert_close(_logits(loaded), ref, rtol=1e-4, atol=1e-4)


class _RunsCode:
    """Unpickling this calls os.system: a checkpoint that would run code on load."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def test_malicious_pickle_is_refused_and_never_runs(tiny, tmp_path):
    folder, _ = tiny
    out = tmp_path / "evil"
    out.mkdir()
    (out / "config.json").write_bytes((folder / "config.json").read_bytes())
    sentinel = tmp_path / "pwned"
    payload = {"model.embed_tokens.weight": _RunsCode(sentinel)}
    torch.save(payload, out / "pytorch_model.bin")
    # The crafted file is real: an unrestricted unpickle runs its command.
    proof = tmp_path / "proof"
    torch.save({"w": _RunsCode(proof)}, tmp_path / "proof.bin")
    torch.load(tmp_path / "proof.bin", weights_only=False)
    assert proof.exists()

    with pytest.raises(UnsafeCheckpointError, match="pytorch_model.bin"):
        _load(out)
    assert not sentinel.exists(), "the pickle's code ran"


def test_missing_model_is_named():
    with pytest.raises(ModelNotFoundError, match="/no/such/model"):
        _load(Path("/no/such/model"))


def test_folder_without_config_or_weights(tiny, tmp_path):
    folder, _ = tiny
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        _load(empty)
    (empty / "config.json").write_bytes((folder / "config.json").read_bytes())
    with pytest.raises(ModelNotFoundError, match="has no weights"):
        _load(empty)


def test_non_gguf_file_is_refused(tmp_path):
    f = tmp_path / "weights.txt"
    f.write_text("hello")
    with pytest.raises(ModelNotFoundError, match=r"weights.txt.*not a \.gguf"):
        _load(f)


def test_unsupported_architecture(tiny, tmp_path):
    folder, _ = tiny
    out = _copy(folder, tmp_path / "arch")
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="MambaForCausalLM") as e:
        _load(out, model_impl="native")
    assert "LlamaForCausalLM" in str(e.value)  # lists what is supported


def test_shape_mismatch_names_tensor_file_and_shapes(tiny, tmp_path):
    folder, _ = tiny
    out = _copy(folder, tmp_path / "shape")
    config = json.loads((out / "config.json").read_text())
    config["intermediate_size"] = 96  # the checkpoint has 128
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightShapeError) as e:
        _load(out)
    msg = str(e.value)
    assert "mlp." in msg and "model.safetensors" in msg
    assert "[128, 64]" in msg or "[64, 128]" in msg
    assert "96" in msg


def test_missing_and_unexpected_tensors(tiny, tmp_path):
    folder, _ = tiny
    state = load_file(str(folder / "model.safetensors"))
    out = _copy(folder, tmp_path / "missing")
    partial = {k: v for k, v in state.items() if "layers.1.mlp.down_proj" not in k}
    save_file(partial, str(out / "model.safetensors"))
    with pytest.raises(MissingWeightsError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        _load(out)

    extra = dict(state, **{"model.layers.0.self_attn.mystery.weight": torch.zeros(2, 2)})
    save_file(extra, str(out / "model.safetensors"))
    with pytest.raises(UnexpectedWeightError, match=r"mystery.*|model.safetensors"):
        _load(out)


def test_corrupt_safetensors_names_the_file(tiny, tmp_path):
    folder, _ = tiny
    out = _copy(folder, tmp_path / "corrupt")
    (out / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        _load(out)


def test_max_model_len_is_checked(tiny):
    folder, _ = tiny
    assert _load(folder, max_model_len=100).max_model_len == 100
    with pytest.raises(ValueError, match="max_model_len 1000 exceeds"):
        _load(folder, max_model_len=1000)


def test_bad_model_config_values():
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(dtype="float64")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device"):
        ModelConfig(device="tpu")
    with pytest.raises(ValueError, match="cpu_gemm must be one of auto, onednn, blas; got 'mkl'"):
        ModelConfig(cpu_gemm="mkl")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cpu_activations must be one of auto, int16, int8; got 'int4'"):
        ModelConfig(cpu_activations="int4")  # type: ignore[arg-type]


def test_cpu_gemm_choice(tiny):
    """auto picks oneDNN where it works for the dtype; blas is always there; float16 is refused by oneDNN."""
    folder, _ = tiny
    auto = _load(folder)
    assert auto.linear_kernel == ("onednn" if onednn.available() else "blas")
    assert f"({auto.linear_kernel} matmuls)" in auto.summary()
    blas = _load(folder, cpu_gemm="blas")
    assert blas.linear_kernel == "blas"
    assert blas.weight_bytes == auto.weight_bytes  # repacking neither adds nor drops a copy
    torch.testing.assert_close(_logits(auto), _logits(blas), rtol=1e-4, atol=1e-4)
    bf16 = _load(folder, dtype="bfloat16")
    assert bf16.linear_kernel == ("onednn" if onednn.available(torch.bfloat16) else "blas")
    assert bf16.weight_bytes * 2 == auto.weight_bytes
    torch.testing.assert_close(_logits(bf16).float(), _logits(auto), rtol=0.05, atol=0.15)
    with pytest.raises(ValueError, match="cpu_gemm 'onednn' needs .* cannot run torch.float16"):
        _load(folder, dtype="float16", cpu_gemm="onednn")


def test_cpu_gemm_falls_back_to_blas_without_onednn(tiny, monkeypatch):
    folder, ref = tiny
    monkeypatch.setattr(onednn, "available", lambda dtype=torch.float32: False)
    loaded = _load(folder)
    assert loaded.linear_kernel == "blas"
    torch.testing.assert_close(_logits(loaded), ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="cpu_gemm 'onednn' needs .* cannot run torch.float32"):
        _load(folder, cpu_gemm="onednn")


def test_auto_dtype_on_cpu_is_float32_for_a_bf16_checkpoint(tmp_path):
    """bfloat16 compute rounds every activation (KLD 7.5x llama.cpp's BF16 on the embedded model,
    docs/benchmarks.md), so `auto` keeps float32 on the CPU; bfloat16 is there when asked for."""
    hf = make_tiny_model("llama", tmp_path)
    hf.to(torch.bfloat16).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert _load(tmp_path).dtype == torch.float32
    assert _load(tmp_path, dtype="bfloat16").dtype == torch.bfloat16
