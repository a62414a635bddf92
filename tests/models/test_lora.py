"""LoRA adapters made by `peft` on tiny random models: our logits against PEFT's on the same
base (float, and int8-quantized with the delta in float), a batch mixing two adapters and the
base against each alone, rsLoRA, and the errors of bad adapter folders."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import transformers

from llmserve.config import ModelConfig
from llmserve.config.lora import LoRAConfig
from llmserve.lora import LoRARequest
from llmserve.lora.manager import LoRAManager
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.model_loader import load_model
from tests.models.test_quantized import fake_quantize
from tests.models.tiny import make_tiny_model

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SOME = ["q_proj", "v_proj", "down_proj"]  # partial shards of qkv_proj and gate_up_proj left out
PROMPTS = [[5, 17, 99, 3, 8, 9], [200, 1, 1, 45, 67, 300, 12], [42, 43]]
TOL = 2e-3


def make_adapter(base: Path, out: Path, targets: list[str], seed: int, r: int = 8, **lora: object) -> Path:
    """A PEFT adapter of rank `r` with random non-zero A and B (init_lora_weights=False), saved to `out`."""
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False, **lora)
    peft.get_peft_model(hf, config).save_pretrained(out)
    return out


def peft_reference(base: Path, adapter: Path | None, quantization: str) -> torch.nn.Module:
    """transformers on the base (its weights as `quantization` stores them) plus PEFT's float delta."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if quantization != "none":
        hf.load_state_dict(fake_quantize(hf.state_dict(), quantization))
    if adapter is not None:
        hf = peft.PeftModel.from_pretrained(hf, adapter)
    return hf.eval()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def base(request, tmp_path_factory) -> tuple[str, Path, list[Path]]:
    folder = tmp_path_factory.mktemp(request.param)
    make_tiny_model(request.param, folder)
    adapters = [
        make_adapter(folder, folder / "lora-all", ALL, seed=1),
        make_adapter(folder, folder / "lora-some", SOME, seed=2),
    ]
    return request.param, folder, adapters


def make_runner(folder: Path, quantization: str, **lora: int) -> tuple[ForwardRunner, LoRAManager]:
    loaded = load_model(
        ModelConfig(
            model=str(folder), quantization=quantization, cpu_activations="int16", show_progress=False
        )
    )
    runner = ForwardRunner(loaded.model, num_blocks=64, block_size=4)
    manager = LoRAManager(loaded.model, LoRAConfig(**lora))
    runner.use_lora(manager)
    return runner, manager


def run_mixed(
    runner: ForwardRunner, lora_ids: list[int], steps: int = 3, prompts: list[list[int]] = PROMPTS
) -> list[torch.Tensor]:
    """Prefill `prompts` together (sequence i with adapter lora_ids[i]), then `steps` decode steps;
    per sequence, its logits at the prompt's positions and every decoded one."""
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    batch = [
        SequenceBatchEntry(s, len(s), t, lora_id=i) for s, t, i in zip(seqs, tables, lora_ids, strict=True)
    ]
    logits = runner.execute(batch, all_logits=True)
    starts = [0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()]
    got = [[logits[a:b]] for a, b in itertools.pairwise(starts)]
    for step in range(steps):
        for s in seqs:
            s.append(7 + step)
        rows = runner.execute(
            [
                SequenceBatchEntry([s[-1]], len(s), t, lora_id=i)
                for s, t, i in zip(seqs, tables, lora_ids, strict=True)
            ]
        )
        for i, row in enumerate(rows):
            got[i].append(row[None])
    return [torch.cat(g) for g in got]


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_mixed_batch_matches_peft(base, quantization):
    """Adapter 1, adapter 2 and the base in one batch (prefill and decode), each sequence against
    PEFT running it alone; the adapters must move the logits well past the tolerance."""
    _, folder, adapters = base
    runner, manager = make_runner(folder, quantization)
    for i, path in enumerate(adapters, start=1):
        manager.add(LoRARequest(f"a{i}", i, str(path)))
    got = run_mixed(runner, [1, 2, 0])
    plain = peft_reference(folder, None, quantization)
    for i, adapter in enumerate([*adapters, None]):
        ref_model = peft_reference(folder, adapter, quantization)
        seq = PROMPTS[i] + [7, 8, 9]
        with torch.no_grad():
            ref = ref_model(torch.tensor([seq])).logits[0]
            without = plain(torch.tensor([seq])).logits[0]
        torch.testing.assert_close(got[i], ref, rtol=TOL, atol=TOL)
        if adapter is not None:
            assert (ref - without).abs().max() > 0.1, "the adapter barely changes the logits"


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_mixed_batch_equals_each_alone(base, quantization):
    """Each sequence of the mixed batch against a batch of its adapter only (the base alone runs
    the fused decoder when quantized). Float agrees to rounding; quantized, a 1e-7 change in an
    activation can move its int16 rounding step, which shows as up to ~3e-4 in the logits."""
    _, folder, adapters = base
    runner, manager = make_runner(folder, quantization)
    for i, path in enumerate(adapters, start=1):
        manager.add(LoRARequest(f"a{i}", i, str(path)))
    mixed = run_mixed(runner, [1, 2, 0])
    for i, lora_id in enumerate([1, 2, 0]):
        alone = run_mixed(runner, [lora_id] * 3)[i]
        tol = 1e-5 if quantization == "none" else TOL
        torch.testing.assert_close(mixed[i], alone, rtol=tol, atol=tol)


def test_rslora(base, tmp_path):
    _, folder, _ = base
    adapter = make_adapter(folder, tmp_path / "rs", ALL, seed=3, use_rslora=True)
    runner, manager = make_runner(folder, "none")
    loaded = manager.add(LoRARequest("rs", 1, str(adapter)))
    assert loaded.scale == pytest.approx(16 / 8**0.5)
    got = run_mixed(runner, [1, 1, 1], steps=0)[0]
    with torch.no_grad():
        ref = peft_reference(folder, adapter, "none")(torch.tensor([PROMPTS[0]])).logits[0]
    torch.testing.assert_close(got, ref, rtol=TOL, atol=TOL)


def _rewrite_tensors(adapter: Path, out: Path, edit) -> Path:
    """A copy of `adapter` whose tensors went through `edit(dict) -> dict`."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    (out / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    save_file(edit(load_file(adapter / "adapter_model.safetensors")), out / "adapter_model.safetensors")
    return out


def test_bad_adapters_are_clear_errors(base, tmp_path):
    arch, folder, adapters = base
    _, manager = make_runner(folder, "none", max_lora_rank=4)
    good = adapters[0]
    with pytest.raises(ValueError, match=r"adapter_config.json: rank 8 is above max_lora_rank 4"):
        manager.add(LoRARequest("big", 1, str(good)))
    _, manager = make_runner(folder, "none")
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    missing = _rewrite_tensors(good, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != q_a})
    with pytest.raises(
        ValueError,
        match=r"adapter_model.safetensors: the adapter of model.layers.0.self_attn.qkv_proj \(shard 0\) lacks its lora_A",
    ):
        manager.add(LoRARequest("missing", 2, str(missing)))
    wider = _rewrite_tensors(good, tmp_path / "wider", lambda t: {**t, q_a: torch.zeros(8, 96)})
    with pytest.raises(
        ValueError,
        match=r"lora_A of model.layers.0.self_attn.qkv_proj \(shard 0\) has shape \(8, 96\); the base model needs \(8, 64\)",
    ):
        manager.add(LoRARequest("wider", 3, str(wider)))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(
        ValueError, match=r"adapter_model.safetensors: cannot read the LoRA adapter's tensors"
    ):
        manager.add(LoRARequest("corrupt", 4, str(corrupt)))
    bad_config = tmp_path / "noconfig"
    bad_config.mkdir()
    with pytest.raises(ValueError, match=r"adapter_config.json: cannot read"):
        manager.add(LoRARequest("noconfig", 5, str(bad_config)))
    stranger = _rewrite_tensors(
        good,
        tmp_path / "stranger",
        lambda t: {**t, "base_model.model.model.layers.9.mlp.up_proj.lora_A.weight": torch.zeros(8, 64)},
    )
    with pytest.raises(
        ValueError, match=r"targets 'model.layers.9.mlp.up_proj.weight', which is no linear layer"
    ):
        manager.add(LoRARequest("stranger", 6, str(stranger)))
    config = json.loads((good / "adapter_config.json").read_text())
    assert config["r"] == 8 and arch in ("llama", "qwen2")


def test_llm_generate_with_adapters_and_prefix_cache(base):
    """The offline API: greedy tokens under each adapter equal PEFT's; one prompt under two
    adapters never shares cached blocks, while a repeat under the same adapter does."""
    from llmserve.engine.llm import LLM
    from llmserve.sampling_params import SamplingParams

    _, folder, adapters = base
    llm = LLM(str(folder), enable_lora=True, max_loras=2, block_size=4, show_progress=False)
    one, two = (LoRARequest(f"a{i}", i, str(p)) for i, p in enumerate(adapters, start=1))
    prompt = list(range(30, 50))  # 5 full blocks of 4
    params = SamplingParams(max_tokens=6, temperature=0.0)
    outs = llm.generate([prompt, prompt, prompt], params, lora_request=[one, two, None], use_tqdm=False)
    for out, adapter in zip(outs, [*adapters, None], strict=True):
        ref = peft_reference(folder, adapter, "none")
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = ref.generate(ids, max_new_tokens=6, do_sample=False)[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == expected
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 3, "the adapters should change the output"
    # the prompt is cached under three identities now: a repeat hits only its own adapter's blocks
    again = llm.generate(prompt, params, lora_request=two, use_tqdm=False)[0]
    assert again.num_cached_tokens == 16 and again.outputs[0].token_ids == outs[1].outputs[0].token_ids
    three = LoRARequest("a3", 3, str(adapters[0]))  # the same folder under a new id: its own blocks
    fresh = llm.generate(prompt, params, lora_request=three, use_tqdm=False)[0]
    assert fresh.num_cached_tokens == 0 and fresh.outputs[0].token_ids == outs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="LoRA is off"):
        LLM(str(folder), block_size=4, show_progress=False).generate(prompt, params, lora_request=one)


def test_least_recently_used_adapter_is_dropped_and_reloaded(base):
    """`max_cpu_loras`: the least recently used adapter is dropped, never one an unfinished
    request runs (`in_use`), and a dropped one is loaded again by the next request naming it."""
    _, folder, adapters = base
    runner, manager = make_runner(folder, "none", max_loras=1, max_cpu_loras=1)
    one, two = (LoRARequest(f"a{i}", i, str(p)) for i, p in enumerate(adapters, start=1))
    manager.add(one)
    manager.add(two, in_use={1})
    assert manager.loaded_ids == [1, 2] and manager.needs_trim  # 1 is busy: over the cap for now
    manager.trim(in_use={2})
    assert manager.loaded_ids == [2]  # 1's requests ended: the least recently used goes
    manager.add(one)  # a new request for the dropped adapter loads it again
    assert manager.loaded_ids == [1] and not manager.needs_trim
    first = run_mixed(runner, [1, 1, 1], steps=1)
    with torch.no_grad():
        ref = peft_reference(folder, adapters[0], "none")(torch.tensor([[*PROMPTS[0], 7]])).logits[0]
    torch.testing.assert_close(first[0], ref, rtol=TOL, atol=TOL)
    # removing a busy adapter keeps its weights until its requests end
    assert manager.remove(1, in_use={1}) and manager.loaded_ids == [1] and manager.needs_trim
    manager.trim(in_use=set())
    assert manager.loaded_ids == [] and not manager.remove(1)


def test_engine_removes_a_busy_adapter_after_its_requests(base):
    """`LLMEngine.remove_lora` while a request runs with the adapter: the request finishes with
    it (the same tokens as without the removal), and the weights go once it has ended."""
    from llmserve.engine.llm import LLM
    from llmserve.sampling_params import SamplingParams

    _, folder, adapters = base
    engine = LLM(str(folder), enable_lora=True, max_loras=1, show_progress=False).engine
    one = LoRARequest("a1", 1, str(adapters[0]))
    params = SamplingParams(max_tokens=6, temperature=0.0)

    def run(remove_after: int | None) -> list[int]:
        engine.add_request(f"r{remove_after}", PROMPTS[0], params, lora_request=one)
        steps, out = 0, None
        while engine.has_unfinished_requests():
            out = engine.step() or out
            steps += 1
            if steps == remove_after:
                assert engine.remove_lora(1) and engine.list_loras() == set()
                assert engine.lora.loaded_ids == [1]  # still running: kept
        return out[0].outputs[0].token_ids

    expected = run(None)
    assert run(remove_after=2) == expected
    assert engine.lora.loaded_ids == [] and not engine.remove_lora(1)
