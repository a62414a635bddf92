"""Tensor parallelism with LoRA adapters (TP=2, one thread per rank) against the same engine at
TP=1: a batch mixing two PEFT adapters (one on every projection, one on some) and the base model,
with prefix caching, chunked prefill and preemption at work, then adapters removed and added at
run time and one dropped and reloaded under `max_cpu_loras` (every rank's manager must follow the
driver's, or the workers fail); float on the layer path, q8 on each rank's fused C++ decoder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from llmserve import LLM
from llmserve.lora import LoRARequest
from llmserve.sampling_params import SamplingParams
from tests.models.test_lora import ALL, SOME, make_adapter
from tests.models.test_tensor_parallel import ENGINE, MAX_TOKENS, PROMPTS
from tests.models.tiny import make_tiny_model

pytest.importorskip("peft")


def _generate(
    model: str, adapters: list[Path], fused: bool, **options
) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs of PROMPTS under [one, two, base, one], then of two
    prompts after `remove_lora(2)` and a third adapter added (max_cpu_loras=2 drops the least
    recently used, reloaded when named again), then the base model alone."""
    llm = LLM(model, enable_lora=True, max_loras=2, max_cpu_loras=2, **ENGINE, **options)
    try:
        assert (llm.engine.runner.runner.fused is not None) == fused
        one, two = (LoRARequest(f"a{i}", i, str(p)) for i, p in enumerate(adapters, start=1))
        three = LoRARequest("a3", 3, str(adapters[1]))
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, lora_request=[one, two, None, one], use_tqdm=False)
        assert llm.engine.remove_lora(2)
        llm.engine.add_lora(three)
        outs += llm.generate(PROMPTS[:2], params, lora_request=[three, one], use_tqdm=False)
        outs += llm.generate(PROMPTS[:1], params, use_tqdm=False)
        assert llm.engine.list_loras() == {1, 3}
    finally:
        llm.engine.close()
    return [
        (
            o.outputs[0].token_ids,
            [lp[t][0] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)],
        )
        for o in outs
    ]


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_tp2_lora_mixed_batch_matches_tp1(quantization, tmp_path):
    """Each rank holds its slice of every adapter (A of o_proj / down_proj cut on the input,
    B of qkv_proj / gate_up_proj on the output): TP=1's tokens, logprobs within the summation
    order (float) or the per-shard activation rounding (q8, test_tensor_parallel)."""
    make_tiny_model("llama", tmp_path)
    adapters = [
        make_adapter(tmp_path, tmp_path / "all", ALL, seed=1),
        make_adapter(tmp_path, tmp_path / "some", SOME, seed=2),
    ]
    fused = quantization == "int8"
    ref = _generate(str(tmp_path), adapters, fused, quantization=quantization)
    got = _generate(
        str(tmp_path), adapters, fused, quantization=quantization, tensor_parallel_size=2, threads_per_rank=1
    )
    assert [t for t, _ in got] == [t for t, _ in ref]
    # the adapters change the answers: PROMPTS[0] under adapter 1, and alone on the base model
    assert ref[0][0] != ref[-1][0]
    atol = 2e-3 if fused else 1e-4
    for (_, lp), (_, ref_lp) in zip(got, ref, strict=True):
        np.testing.assert_allclose(np.array(lp), np.array(ref_lp), rtol=0, atol=atol)
