"""Pre-quantized HF checkpoints end to end: tiny Llama, Qwen2 (with biases) and Phi-3 (q, k, v and
gate, up quantized fused, as its checkpoints store them) models quantized in
the test with each format's own packing rules (prequant_writer.py: GPTQ sym / asym, v1 / v2, with
and without act-order; AWQ; FP8 per tensor / per channel), loaded by llmserve with the default
`quantization auto`, against transformers running the dequantized float model; `none` and `int8`;
the load report; and the checkpoints that are refused."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers

from llmserve import LLM, SamplingParams
from llmserve.config import ModelConfig
from llmserve.layers.linear import Linear
from llmserve.layers.quantization import Fp8Linear, QuantizedLinear
from llmserve.layers.quantization.fp8 import quantize_fp8
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.greedy import generate_greedy
from llmserve.model_executor.model_loader import load_model
from tests.models import prequant_writer as pw
from tests.models.tiny import hf_greedy, save_tiny_tokenizer

PROMPTS = [[5, 17, 99, 3], [200, 1, 1, 45, 67, 300, 12, 9, 8, 7, 6, 5, 4, 3, 2, 11, 400, 401, 402, 25], [42]]
EXACT = 5e-3  # weights the dequantized model's (bit for bit, tested below); activations rounded
# to int16 per token inside each matmul: over sums of 256-512 terms, logits move by up to ~3e-3
ROUNDED = 5e-2  # plus m = -z d rounded to fp16 (asymmetric q4): ~1/100 of the quantization's own effect


def _order(prefix: str, K: int) -> torch.Tensor:
    """Act-order's quantization order: one per input (q, k, v share theirs, as gate and up do,
    since GPTQ sorts by the Hessian of the layer's input)."""
    layer = int(re.search(r"layers\.(\d+)", prefix).group(1))  # type: ignore[union-attr]
    kind = next(
        i
        for i, k in enumerate(("q_proj|k_proj|v_proj", "gate_proj|up_proj", "o_proj", "down_proj"))
        if re.search(k, prefix)
    )
    return torch.randperm(K, generator=torch.Generator().manual_seed(10 * layer + kind))


@dataclass(frozen=True)
class Case:
    arch: str  # "llama" (hidden 256) or "qwen2" (hidden 128, q/k/v biases, tied embeddings)
    config: dict
    quantize: object  # (prefix, w) -> (tensors, dequantized)
    tol: float
    label: str


def _gptq(gs: int, sym: bool, act: bool, v1: bool) -> tuple[dict, object]:
    config = {"quant_method": "gptq", "bits": 4, "group_size": gs, "sym": sym, "desc_act": act}
    config["checkpoint_format"] = "gptq" if v1 else "gptq_v2"
    return config, lambda p, w: pw.gptq(w, gs, sym, _order(p, w.shape[1]) if act else None, v1)


CASES = {
    "gptq-sym-llama": Case("llama", *_gptq(128, True, False, True), EXACT, "gptq (4-bit, group 128) -> q4"),
    "gptq-act-asym-llama": Case(
        "llama",
        *_gptq(128, False, True, False),
        ROUNDED,
        "gptq (4-bit, group 128, act-order, asymmetric) -> q4",
    ),
    "gptq-act-sym-qwen2": Case(
        "qwen2", *_gptq(32, True, True, True), EXACT, "gptq (4-bit, group 32, act-order) -> q4"
    ),
    "gptq-act-sym-phi3": Case(
        "phi3", *_gptq(128, True, True, True), EXACT, "gptq (4-bit, group 128, act-order) -> q4"
    ),
    "awq-phi3": Case(
        "phi3",
        {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
        lambda p, w: pw.awq(w, 64),
        ROUNDED,
        "awq (4-bit, group 64, asymmetric) -> q4",
    ),
    "fp8-tensor-phi3": Case(
        "phi3",
        {"quant_method": "fp8", "activation_scheme": "static"},
        lambda p, w: pw.fp8(w, per_channel=False, scale_dtype=torch.float32),
        1e-4,
        "fp8 (e4m3) -> fp8",
    ),
    "awq-llama": Case(
        "llama",
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
        lambda p, w: pw.awq(w, 128),
        ROUNDED,
        "awq (4-bit, group 128, asymmetric) -> q4",
    ),
    "awq-qwen2": Case(
        "qwen2",
        {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True, "version": "GEMM"},
        lambda p, w: pw.awq(w, 64),
        ROUNDED,
        "awq (4-bit, group 64, asymmetric) -> q4",
    ),
    "fp8-tensor-llama": Case(
        "llama",
        {"quant_method": "fp8", "activation_scheme": "static"},
        lambda p, w: pw.fp8(w, per_channel=False, scale_dtype=torch.float32),
        1e-4,
        "fp8 (e4m3) -> fp8",
    ),
    "fp8-channel-qwen2": Case(
        "qwen2",
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True},
                    "input_activations": {
                        "type": "float",
                        "num_bits": 8,
                        "strategy": "token",
                        "dynamic": True,
                    },
                }
            },
            "ignore": ["lm_head"],
        },
        lambda p, w: pw.fp8(w, per_channel=True, scale_dtype=torch.bfloat16),
        1e-4,
        "fp8 (e4m3, compressed-tensors) -> fp8",
    ),
}


def _tiny_hf(arch: str, folder: Path) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    common = dict(vocab_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    common.update(max_position_embeddings=256, initializer_range=0.15)
    if arch == "llama":
        config = transformers.LlamaConfig(
            **common, hidden_size=256, intermediate_size=512, tie_word_embeddings=False
        )
    elif arch == "phi3":  # q, k, v and gate, up quantized as the fused tensors the checkpoint holds
        config = transformers.Phi3Config(
            **common, hidden_size=256, intermediate_size=512, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=0, pad_token_id=None,
        )  # fmt: skip
    else:
        config = transformers.Qwen2Config(
            **common, hidden_size=128, intermediate_size=256, tie_word_embeddings=True
        )
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(folder)
    save_tiny_tokenizer(folder, 512)
    return hf


def _round_inputs(hf: transformers.PreTrainedModel) -> None:
    """FP8's arithmetic in transformers: each projection's input rounded to e4m3 per token."""

    def hook(module: torch.nn.Module, args: tuple) -> tuple:
        q, scale = quantize_fp8(args[0].reshape(-1, args[0].shape[-1]))
        return ((q.float() * scale[:, None]).view(args[0].shape),)

    for name, m in hf.named_modules():
        if isinstance(m, torch.nn.Linear) and name != "lm_head":
            m.register_forward_pre_hook(hook)


def make_checkpoint(case: Case, folder: Path) -> transformers.PreTrainedModel:
    """The checkpoint in `folder`, and transformers on its dequantized weights."""
    hf = _tiny_hf(case.arch, folder)
    pw.write_prequantized(folder, hf, case.config, case.quantize)
    if case.config["quant_method"] in ("fp8", "compressed-tensors"):
        _round_inputs(hf)
    return hf


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    case = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(case, folder)
    return case, hf, load_model(ModelConfig(model=str(folder), show_progress=False)), folder


def _logits(loaded, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's logits at every position, all prompts in one batch."""
    runner = ForwardRunner(loaded.model, num_blocks=24, block_size=4, profile=loaded.profile)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(seqs))]
    entries = [SequenceBatchEntry(s, len(s), t) for s, t in zip(seqs, tables, strict=True)]
    rows = runner.execute(entries, all_logits=True)
    return list(rows.split([len(s) for s in seqs]))


def test_logits_match_the_dequantized_model(pair):
    case, hf, loaded, _ = pair
    for seq, got in zip(PROMPTS, _logits(loaded, PROMPTS), strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0]
        torch.testing.assert_close(got, ref, rtol=case.tol, atol=case.tol)


def test_greedy_matches_the_dequantized_model(pair):
    """Token for token; where they part, transformers scores our token within tol of its own."""
    case, hf, loaded, _ = pair
    runner = ForwardRunner(loaded.model, num_blocks=64, block_size=4, profile=loaded.profile)
    for p, ours in zip(PROMPTS, generate_greedy(runner, PROMPTS, 12), strict=True):
        theirs, logits = hf_greedy(hf, p, 12)
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            if a != b:
                assert float(logits[i][b] - logits[i][a]) <= case.tol, (
                    f"token {i}: ours {a}, transformers {b}"
                )
                break


def test_load_report_and_layers(pair):
    case, _, loaded, _ = pair
    assert loaded.quantization == case.label
    assert f"quantization {case.label}" in loaded.summary()
    kind = Fp8Linear if case.label.endswith("fp8") else QuantizedLinear
    linears = [m for m in loaded.model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m, kind) for m in linears)
    fmts = {(g.role, g.fmt) for g in loaded.weight_groups}
    fmt = "fp8" if kind is Fp8Linear else "q4"
    assert {("attention", fmt), ("mlp", fmt), ("embedding", "float32")} <= fmts  # embeddings stay float
    # q4 weights take the CPU's 16-bit KV cache by default; fp8's reference path keeps float32
    assert loaded.kv_cache_dtype().k == (torch.float32 if fmt == "fp8" else torch.float16)


def test_exact_formats_hold_the_dequantized_weights(pair):
    """Symmetric GPTQ and FP8: every layer's weight is the checkpoint's dequantized weight, bit
    for bit (fused q | k | v and gate | up in their order)."""
    case, hf, loaded, _ = pair
    if case.tol == ROUNDED:
        pytest.skip("asymmetric zero points: m rounded to fp16")
    state = hf.state_dict()
    for path, m in loaded.model.named_modules():
        if isinstance(m, Linear):
            names = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
            leaf = path.rsplit(".", 1)[1]
            parent = path.rsplit(".", 1)[0]
            if f"{path}.weight" in state:  # stored fused (Phi-3)
                expected = state[f"{path}.weight"]
            else:
                expected = torch.cat([state[f"{parent}.{n}.weight"] for n in names.get(leaf, [leaf])])
            assert torch.equal(m.logical_weight(), expected), path


def test_fused_decoder_runs_unless_act_order(pair):
    case, _, loaded, _ = pair
    runner = ForwardRunner(loaded.model, num_blocks=8, block_size=4, profile=loaded.profile)
    if case.label.endswith("q4") and "act-order" not in case.label:
        assert runner.fused is not None
    elif "act-order" in case.label:
        assert runner.fused is None and "act-order" in str(runner.fused_unsupported)


def _checkpoint(name: str, tmp_path: Path) -> tuple[transformers.PreTrainedModel, Path]:
    return make_checkpoint(CASES[name], tmp_path), tmp_path


def test_none_dequantizes_to_the_float_model(tmp_path):
    """`quantization none`, as on CUDA where no 4-bit kernel runs: float weights, the format's own
    dequantization, so the logits are transformers' to float32 summation order."""
    hf, folder = _checkpoint("gptq-act-asym-llama", tmp_path)
    loaded = load_model(ModelConfig(model=str(folder), quantization="none", show_progress=False))
    assert loaded.quantization == "gptq (4-bit, group 128, act-order, asymmetric) -> float (dequantized)"
    assert not any(isinstance(m, QuantizedLinear) for m in loaded.model.modules())
    got = _logits(loaded, PROMPTS[1:2])[0]
    with torch.no_grad():
        torch.testing.assert_close(got, hf(torch.tensor([PROMPTS[1]])).logits[0], rtol=1e-4, atol=1e-4)


def test_no_4bit_kernel_dequantizes_with_a_warning(tmp_path, caplog):
    """A float16 model (as on CUDA, where no 4-bit kernel runs): the weights are dequantized."""
    hf, folder = _checkpoint("gptq-sym-llama", tmp_path)
    with caplog.at_level("WARNING", logger="llmserve"):
        loaded = load_model(ModelConfig(model=str(folder), dtype="float16", show_progress=False))
    assert loaded.quantization.endswith("-> float (dequantized)")
    assert "dequantized to float16 at load" in caplog.text
    q_proj = hf.state_dict()["model.layers.0.self_attn.q_proj.weight"].half()
    assert torch.equal(loaded.model.model.layers[0].self_attn.qkv_proj.logical_weight()[:256], q_proj)


def test_int8_holds_asymmetric_codes_exactly(tmp_path):
    """q8 blocks store q - z (int8) with the scale: no minimum to round."""
    hf, folder = _checkpoint("awq-llama", tmp_path)
    loaded = load_model(ModelConfig(model=str(folder), quantization="int8", show_progress=False))
    assert loaded.quantization == "awq (4-bit, group 128, asymmetric) -> q8"
    state = hf.state_dict()
    down = loaded.model.model.layers[1].mlp.down_proj
    assert torch.equal(down.logical_weight(), state["model.layers.1.mlp.down_proj.weight"])
    got = _logits(loaded, PROMPTS[1:2])[0]
    with torch.no_grad():
        torch.testing.assert_close(got, hf(torch.tensor([PROMPTS[1]])).logits[0], rtol=EXACT, atol=EXACT)


def test_llm_generates_the_dequantized_models_tokens(tmp_path):
    """The whole engine (scheduler, sampler) on an act-order checkpoint with biases."""
    hf, folder = _checkpoint("gptq-act-sym-qwen2", tmp_path)
    llm = LLM(str(folder), show_progress=False, num_kv_blocks=32, block_size=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for p, o in zip(PROMPTS, out, strict=True):
        assert list(o.outputs[0].token_ids) == hf_greedy(hf, p, 8)[0]


# -- refused checkpoints ------------------------------------------------------------------------------


def _edit(folder: Path, config: dict | None = None, drop: str | None = None, bits: int | None = None) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = folder / "model.safetensors"
    if drop is not None:
        with safe_open(str(path), framework="pt") as sf:
            state = {k: sf.get_tensor(k) for k in sf.keys() if k != drop}  # noqa: SIM118
        save_file(state, str(path))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"].update(config or {})
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("case", "edit", "kw", "message"),
    [
        ("gptq-sym-llama", {"config": {"bits": 8}}, {}, "gptq.*bits 8"),
        ("gptq-sym-llama", {"config": {"quant_method": "hqq"}}, {}, "quant_method 'hqq'"),
        ("gptq-sym-llama", {"drop": "model.layers.1.mlp.up_proj.scales"}, {}, "lacks tensor model.layers.1.mlp.up_proj.scales"),
        ("gptq-sym-llama", {"drop": "model.layers.0.self_attn.k_proj.qweight"}, {}, r"fused layer model.layers.0.self_attn.qkv_proj: shards \[1\]"),
        ("gptq-sym-llama", {}, {"quantization": "fp8"}, "'fp8' does not apply"),
        ("fp8-tensor-llama", {}, {"quantization": "int4"}, "'int4' does not apply"),
        ("gptq-sym-llama", {}, {"model_impl": "transformers"}, "pre-quantized"),
    ],
)  # fmt: skip
def test_bad_checkpoints_are_refused_naming_the_field(tmp_path, case, edit, kw, message):
    make_checkpoint(CASES[case], tmp_path)
    _edit(tmp_path, **edit)
    with pytest.raises(ValueError, match=message):
        load_model(ModelConfig(model=str(tmp_path), show_progress=False, **kw))


def test_wrong_shape_names_the_tensor(tmp_path):
    make_checkpoint(CASES["awq-llama"], tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 384  # the checkpoint's MLP is 512 wide
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # the layer's logical weight (its qweight, qzeros and scales as one [out, in] matrix) is named
    with pytest.raises(
        ValueError, match=r"'model.layers.0.mlp.down_proj.weight'.*\[256, 512\].*\[256, 384\]"
    ):
        load_model(ModelConfig(model=str(tmp_path), show_progress=False))
