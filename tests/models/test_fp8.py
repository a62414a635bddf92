"""`quantization="fp8"` end to end on the CPU (the float32 reference path, the GPU's numbers):
a tiny Llama against transformers running the same FP8 arithmetic (weights rounded per channel,
every linear input rounded per token, independently of the loader), against its float self
(logits, greedy tokens, KL divergence through `llmserve eval perplexity`), the load report, and
the combinations that are refused."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from llmserve import LLM, SamplingParams
from llmserve.bench.quality import evaluate
from llmserve.config import ModelConfig
from llmserve.config.engine_args import EngineArgs
from llmserve.layers.linear import Linear
from llmserve.layers.quantization import Fp8Linear
from llmserve.layers.quantization.fp8 import quantize_fp8
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.greedy import generate_greedy
from llmserve.model_executor.model_loader import load_model
from tests.gguf_writer import hf_metadata, write_gguf, write_hf_model
from tests.models.tiny import make_tiny_model

PROMPTS = [[5, 17, 99, 3], [200, 1, 1, 45, 67, 300, 12, 9, 8, 7, 6, 5, 4, 3, 2, 11, 400, 401, 402, 25], [42]]
_PROJ = re.compile(r"(q|k|v|o|gate|up|down)_proj\.weight$")
TEXT_IDS = [int(x) for x in torch.randint(1, 512, (3 * 32 + 7,), generator=torch.Generator().manual_seed(7))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8-llama")
    return folder, make_tiny_model("llama", folder)


def _load(folder, **kw):
    return load_model(ModelConfig(model=str(folder), show_progress=False, **kw))


def _logits(loaded, prompt: list[int]) -> torch.Tensor:
    runner = ForwardRunner(loaded.model, num_blocks=8, block_size=4, profile=loaded.profile)
    return runner.execute([SequenceBatchEntry(prompt, len(prompt), list(range(5)))], all_logits=True)


def fp8_transformers(hf: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """`hf` computing what llmserve's fp8 computes: projection weights rounded to e4m3 per output
    channel, each projection's input rounded per token (a forward pre-hook); LM head float."""
    state = hf.state_dict()
    for name, w in state.items():
        if _PROJ.search(name):
            q, scale = quantize_fp8(w)
            state[name] = q.float() * scale[:, None]
    hf.load_state_dict(state)

    def round_input(module: torch.nn.Module, args: tuple) -> tuple:
        x = args[0]
        q, scale = quantize_fp8(x.reshape(-1, x.shape[-1]))
        return ((q.float() * scale[:, None]).view(x.shape),)

    for name, m in hf.named_modules():
        if isinstance(m, torch.nn.Linear) and name != "lm_head":
            m.register_forward_pre_hook(round_input)
    return hf


def test_fp8_llama_is_the_fp8_arithmetic(tiny, tmp_path):
    """Same arithmetic, different summation order: nearly every logit agrees to 1e-4. An
    activation within float32 rounding of an e4m3 rounding boundary may round the other way on
    one side (a 2^-4 step on one element), moving some logits by a few hundredths: allowed for
    a few, while the float model is ~0.8 away (next test)."""
    folder, _ = tiny
    hf = fp8_transformers(
        transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    )
    loaded = _load(folder, quantization="fp8")
    for prompt in PROMPTS:
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0]
        diff = (_logits(loaded, prompt) - want).abs()
        assert diff.max() < 0.1
        assert (diff > 1e-4).float().mean() < 0.05


def test_fp8_is_close_to_the_float_model(tiny):
    """e4m3 rounds every weight and linear input with up to 2^-4 relative error (~2.5% rms); in
    two untrained layers of width 64 that compounds to 11-18% of the logits' spread (measured);
    0.25 leaves room. Greedy choices agree where the float model's lead is clear: the first
    three tokens of every prompt (later ones diverge after the first near-tie, as they would for
    any rounding; the teacher-forced agreement is measured in the KLD test)."""
    folder, _ = tiny
    fp8, ref = _load(folder, quantization="fp8"), _load(folder, quantization="none")
    for prompt in PROMPTS:
        a, b = _logits(fp8, prompt), _logits(ref, prompt)
        assert 0 < ((a - b).pow(2).mean().sqrt() / b.std()) < 0.25
    got = generate_greedy(ForwardRunner(fp8.model, 64, 4), PROMPTS, 8)
    want = generate_greedy(ForwardRunner(ref.model, 64, 4), PROMPTS, 8)
    assert [g[:3] for g in got] == [w[:3] for w in want]


def test_fp8_divergence_is_small_and_above_int8s(tiny):
    """KL divergence from the float model: positive (fp8 really ran), small, and larger than
    int8's (32-value blocks at 8 bits round 16x finer than e4m3's 3 mantissa bits)."""
    reference = _load(tiny[0], quantization="none")
    fp8 = evaluate(_load(tiny[0], quantization="fp8"), TEXT_IDS, 32, reference=reference)
    int8 = evaluate(
        _load(tiny[0], quantization="int8", cpu_activations="int16"), TEXT_IDS, 32, reference=reference
    )
    assert 0 < int8.kld < fp8.kld < 0.05
    assert fp8.top1 >= 0.7


def test_load_report_names_the_fp8_groups(tiny):
    loaded = _load(tiny[0], quantization="fp8")
    assert loaded.quantization == "fp8"
    assert loaded.num_params == _load(tiny[0], quantization="none").num_params
    linears = [m for m in loaded.model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m, Fp8Linear) and m.kernel == "reference" for m in linears)
    groups = {(g.role, g.fmt): g.num_bytes for g in loaded.weight_groups}
    # Llama tiny: per layer qkv [128, 64], o [64, 64], gate_up [256, 64], down [64, 128]: one byte
    # a weight and a float32 scale per output row.
    attn = 2 * (128 * 64 + 4 * 128 + 64 * 64 + 4 * 64)
    mlp = 2 * (256 * 64 + 4 * 256 + 64 * 128 + 4 * 64)
    assert groups[("attention", "fp8")] == attn and groups[("mlp", "fp8")] == mlp
    assert groups[("embedding", "float32")] == groups[("lm_head", "float32")] == 512 * 64 * 4
    assert "fp8 on float32 reference" in loaded.linear_kernel
    assert "attention fp8" in loaded.summary() and "mlp fp8" in loaded.summary()
    assert loaded.kv_cache_dtype().k == torch.float32  # the reference path keeps the model's K/V


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "gpt2", "llama3-rope-tied"])
def test_every_architecture_takes_fp8(arch, tmp_path):
    make_tiny_model(arch, tmp_path)
    fp8, ref = _load(tmp_path, quantization="fp8"), _load(tmp_path, quantization="none")
    assert all(isinstance(m, Fp8Linear) for m in fp8.model.modules() if isinstance(m, Linear))
    a, b = _logits(fp8, PROMPTS[1]), _logits(ref, PROMPTS[1])
    assert 0 < ((a - b).pow(2).mean().sqrt() / b.std()) < 0.3


def test_llm_and_engine_args_take_fp8(tiny):
    assert EngineArgs.from_options({"quantization": "fp8"}, "models file").quantization == "fp8"
    llm = LLM(str(tiny[0]), quantization="fp8", show_progress=False, num_kv_blocks=32, block_size=4)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_cli_eval_perplexity_fp8(tiny, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. 0123456789 naïve café. " * 30)
    report = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "llmserve.cli.main", "eval", "perplexity", "--model", str(tiny[0]),
           "--quantization", "fp8", "--reference-dtype", "bfloat16", "--text", str(text), "--ctx", "64",
           "--json", str(report)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    data = json.loads(report.read_text())
    assert data["quantization"] == "fp8" and data["reference_dtype"] == "bfloat16"
    assert 0 < data["kld"] < 0.1


# -- refused combinations ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory, tiny):
    """The tiny Llama as a GGUF with Q8_0 projection weights (and the F32 original)."""
    from gguf import GGUFReader

    tmp = tmp_path_factory.mktemp("fp8-gguf")
    hf = tiny[1]
    hf.config.architectures = ["LlamaForCausalLM"]
    f32 = write_hf_model(tmp / "f32.gguf", "llama", hf.config, hf.state_dict())[0]
    tensors = {}
    for t in GGUFReader(f32).tensors:
        arr = np.array(t.data).reshape(list(reversed(t.shape.tolist())))
        tensors[t.name] = (
            (arr, Q.Q8_0)
            if t.name.startswith("blk.") and t.name.endswith("weight") and arr.ndim == 2
            else arr
        )
    return f32, write_gguf(tmp / "q8.gguf", "llama", tensors, hf_metadata("llama", hf.config))[0]


def test_fp8_takes_a_float_gguf_and_refuses_a_quantized_one(q8_gguf):
    f32, q8 = q8_gguf
    assert _load(f32, quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match=r"fp8.*already quantized \(Q8_0\)"):
        _load(q8, quantization="fp8")


def test_fp8_refuses_the_transformers_implementation(tiny):
    with pytest.raises(ValueError, match="fp8"):
        _load(tiny[0], quantization="fp8", model_impl="transformers")


def test_fp8_config_over_float_tensors_is_refused_clearly(tmp_path):
    """Pre-quantized FP8 checkpoints load (tests/models/test_prequantized.py); a config that says
    fp8 over float tensors is named as such."""
    make_tiny_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="says fp8, but the checkpoint has no float8_e4m3fn weight"):
        _load(tmp_path, quantization="fp8")


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig(quantization="fp4")  # type: ignore[arg-type]
