"""llama.cpp's GGUF LoRA adapters: a PEFT adapter written as `convert_lora_to_gguf.py` writes it
(gguf's GGUFWriter; llama's q/k lora_B rows permuted for ggml's RoPE, as the converter's
LoraTorchTensor permutes them) gives the same logits and greedy tokens as its PEFT folder; bad
files are clear errors naming the file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from llmserve.lora import LoRARequest
from tests.models.test_lora import PROMPTS, base, make_runner, run_mixed  # noqa: F401 (fixture)

# HF module -> GGUF base name (llama.cpp's tensor names for llama and qwen2)
_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
N_HEAD, N_KV_HEAD = 4, 2  # tests/models/tiny.py


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order: within a head, (x0.., y0..) -> (x0, y0, x1, y1, ...)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_adapter(
    peft_dir: Path, out: Path, arch: str, alpha: float = 16.0, general_type: str = "adapter"
) -> Path:
    writer = gguf.GGUFWriter(out, arch)
    writer.add_string("general.type", general_type)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for key, tensor in load_file(peft_dir / "adapter_model.safetensors").items():
        # base_model.model.model.layers.N.<module>.lora_{A,B}.weight
        parts = key.removeprefix("base_model.model.model.layers.").split(".")
        block, module, half = parts[0], ".".join(parts[1:3]), parts[3]
        w = tensor.float().numpy()
        if arch == "llama" and half == "lora_B" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            w = _llama_permute(w, N_HEAD if module == "self_attn.q_proj" else N_KV_HEAD)
        name = f"blk.{block}.{_GGUF_NAMES[module]}.weight.lora_{half[-1].lower()}"
        writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_gguf_adapter_equals_its_peft_twin(base, tmp_path):  # noqa: F811 (the fixture)
    arch, folder, adapters = base
    twin = write_gguf_adapter(adapters[0], tmp_path / "adapter.gguf", arch)
    runner, manager = make_runner(folder, "none", max_loras=2)
    peft_adapter = manager.add(LoRARequest("peft", 1, str(adapters[0])))
    gguf_adapter = manager.add(LoRARequest("gguf", 2, str(twin)))
    assert gguf_adapter.scale == peft_adapter.scale == 2.0 and gguf_adapter.rank == 8  # alpha 16 / r 8
    want, got = run_mixed(runner, [1, 1, 1]), run_mixed(runner, [2, 2, 2])
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_llm_generate_with_a_gguf_adapter(base, tmp_path):  # noqa: F811
    from llmserve.engine.llm import LLM
    from llmserve.sampling_params import SamplingParams

    arch, folder, adapters = base
    twin = write_gguf_adapter(adapters[1], tmp_path / "some.gguf", arch)  # q, v, down only
    llm = LLM(str(folder), enable_lora=True, show_progress=False)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    peft_out, gguf_out, plain = llm.generate(
        [PROMPTS[1]] * 3,
        params,
        lora_request=[LoRARequest("p", 1, str(adapters[1])), LoRARequest("g", 2, str(twin)), None],
        use_tqdm=False,
    )
    assert gguf_out.outputs[0].token_ids == peft_out.outputs[0].token_ids != plain.outputs[0].token_ids


def test_bad_gguf_adapters_are_clear_errors(base, tmp_path):  # noqa: F811
    arch, folder, adapters = base
    _, manager = make_runner(folder, "none")
    other = "qwen2" if arch == "llama" else "llama"
    cases = {
        "wrong-arch.gguf": (
            write_gguf_adapter(adapters[0], tmp_path / "wrong-arch.gguf", other),
            f"the adapter is for '{other}'",
        ),
        "model.gguf": (
            write_gguf_adapter(adapters[0], tmp_path / "model.gguf", arch, general_type="model"),
            "not a GGUF LoRA adapter (general.type 'model'",
        ),
    }
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(cases["model.gguf"][0].read_bytes()[:200])
    cases["corrupt.gguf"] = (corrupt, "cannot read the GGUF LoRA adapter")
    cases["missing.gguf"] = (tmp_path / "missing.gguf", "cannot read the GGUF LoRA adapter")
    for i, (name, (path, message)) in enumerate(cases.items(), start=1):
        with pytest.raises(ValueError, match=rf"{name}: .*") as info:
            manager.add(LoRARequest(name, i, str(path)))
        assert message in str(info.value), (name, str(info.value))
    assert manager.loaded_ids == []
