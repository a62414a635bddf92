"""Tensor parallelism (TP=2, one thread per rank) against the same engine at TP=1: greedy tokens
equal and logprobs within float tolerance on tiny Llama-family models (float safetensors and a
Q4_1 GGUF), with prefix caching, chunked prefill and preemption at work; refusals of what it
cannot split; a worker that dies stops the engine with an error naming it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from llmserve import LLM
from llmserve.engine.llm import build_engine
from llmserve.model_executor.tp_executor import TensorParallelError
from llmserve.sampling_params import SamplingParams
from tests.gguf_writer import tiny_llama_gguf
from tests.models.tiny import make_tiny_model

SHARED = [200, 1, 1, 45, 67, 300, 12, 9, 8, 7, 6, 5, 4, 3, 2, 11, 400, 401]  # > one block of 16
PROMPTS = [[*SHARED, 25, 26], [*SHARED, 30], [5, 17, 99, 3], [*SHARED, 41, 42, 43]]
# A small step budget splits the prompts into chunks; 5 blocks of 16 cannot hold all four
# requests at once (each needs 2-3 blocks, 9 in all), so the newest are preempted and recomputed.
ENGINE = dict(show_progress=False, max_num_batched_tokens=8, num_kv_blocks=5, block_size=16, max_num_seqs=4)
MAX_TOKENS = 16


def _run(
    model: str,
    fused: bool | None = None,
    inspect: Callable[[LLM], None] | None = None,
    prompts: list[list[int]] = PROMPTS,
    max_tokens: int = MAX_TOKENS,
    **options,
) -> tuple[list[list[int]], list[list[float]], int]:
    """(greedy tokens, each chosen token's logprob, preemptions) of `prompts`; `fused`: assert
    whether the (driver's) stack runs the fused C++ decoder; `inspect(llm)` before it runs."""
    llm = LLM(model, **ENGINE, **options)
    try:
        if inspect is not None:
            inspect(llm)
        if fused is not None:
            runner = llm.engine.runner.runner
            assert (runner.fused is not None) == fused, runner.fused_unsupported
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        preemptions = llm.engine.scheduler.num_preemptions
        if fused is not None:  # the shared prefix was served from the cache
            assert llm.engine.scheduler.kv_cache_manager.prefix_cache_stats.hits > 0
    finally:
        llm.engine.close()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [
        [lp[t][0] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)] for o in outs
    ]
    return tokens, logprobs, preemptions


def compare_tp(model: str, atol: float = 1e-4, backend: str = "mp", **options) -> None:
    """TP=2 (one thread per rank, its workers started by `backend`) against TP=1 on PROMPTS."""
    ref_tokens, ref_lp, ref_preempt = _run(model, **options)
    tp_tokens, tp_lp, tp_preempt = _run(
        model, tensor_parallel_size=2, threads_per_rank=1, distributed_executor_backend=backend, **options
    )
    assert ref_preempt > 0 and tp_preempt == ref_preempt  # preemption was exercised, alike
    assert tp_tokens == ref_tokens
    # the all-reduce sums partial products in another order: logprobs agree to float rounding
    np.testing.assert_allclose(np.array(tp_lp), np.array(ref_lp), rtol=0, atol=atol)


@pytest.mark.parametrize(
    "name",
    ["llama", "llama3-rope-tied", "mistral-sliding", "qwen2", "qwen3", "gemma3", "gemma2", "granite", "exaone4",
     "phi3", "granite-moe", "starcoder2", "olmo2"],
)  # fmt: skip
def test_tp2_matches_tp1_float(name, tmp_path):
    make_tiny_model(name, tmp_path)
    compare_tp(str(tmp_path))


def test_tp2_matches_tp1_int8_quantized_at_load(tmp_path):
    """A float checkpoint quantized to q8 rows as each rank loads its slices (3e-4 seen: the
    row-parallel layers' activations are rounded per shard, as with the GGUF below)."""
    make_tiny_model("llama", tmp_path)
    compare_tp(str(tmp_path), atol=2e-3, quantization="int8")


def test_tp2_matches_tp1_q4_1_gguf(tmp_path):
    # q4 matmuls round each token's activations to int16 with one scale per row of the input
    # they see: a row-parallel shard's scale comes from its half of the row, so logprobs move by
    # that rounding (6e-4 seen), more than the float models' summation order (< 1e-5)
    # Every matrix Q4_1 (the tied embedding too), as the embedded SmolLM2 file stores them;
    # o_proj's and down_proj's 128 / 256 input columns per rank split on whole blocks.
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd")
    compare_tp(str(tiny_llama_gguf(tmp_path, dict.fromkeys(kinds, Q.Q4_1), tokenizer=True)), atol=2e-3)


def test_tp2_matches_tp1_q6_k_gguf(tmp_path):
    """Q6_K matrices held as q6 (their own super-blocks of 256 columns) on each rank: down_proj's
    256 input columns per rank are one whole super-block, the vocabulary-parallel table's rows and
    the column-parallel layers' rows split anywhere. (o_proj, Q4_1 here: a Q6_K o_proj's 128
    columns a rank would cut a super-block and be held as q8, other weights than TP=1's q6, so
    not the same tokens; tests/unit/test_q6.py checks that cut.) Fused on both."""
    kinds = ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up", "ffn_down", "token_embd")

    def formats(llm: LLM) -> None:
        layer = llm.engine.runner.runner.model.model.layers[0]
        assert layer.mlp.down_proj.fmt == layer.mlp.gate_up_proj.fmt == "q6"

    types = {**dict.fromkeys(kinds, Q.Q6_K), "attn_output": Q.Q4_1}
    path = str(tiny_llama_gguf(tmp_path, types, tokenizer=True))
    ref_tokens, ref_lp, _ = _run(path, fused=True, inspect=formats)
    tp_tokens, tp_lp, _ = _run(path, fused=True, tensor_parallel_size=2, threads_per_rank=1)
    assert tp_tokens == ref_tokens
    np.testing.assert_allclose(np.array(tp_lp), np.array(ref_lp), rtol=0, atol=2e-3)


def test_olmo2_shards_run_their_layers_and_sum_the_norms_squares(tmp_path):
    """OLMo 2's q and k norms span every head: under TP=2 (shared memory, where other stacks take
    the fused decoder) its shards run their layers, each norm summing its heads' squares over the
    group; int8 weights: the same greedy tokens as TP=1's fused decoder."""
    make_tiny_model("olmo2", tmp_path)
    ref_tokens, ref_lp, _ = _run(str(tmp_path), fused=True, quantization="int8")
    tp_tokens, tp_lp, _ = _run(
        str(tmp_path), fused=False, quantization="int8", tensor_parallel_size=2, threads_per_rank=1
    )
    assert tp_tokens == ref_tokens
    np.testing.assert_allclose(np.array(tp_lp), np.array(ref_lp), rtol=0, atol=2e-3)


@pytest.mark.parametrize("source", ["int8", "q4_1-gguf", "gemma3-int8"])
def test_tp2_fused_decoder_matches_tp1(source, tmp_path, monkeypatch):
    """Each rank runs its shard of the stack in the fused C++ decoder, summing the o and down
    projections' shares over the shared-memory group inside the call: greedy tokens equal TP=1's
    (itself fused) and the layer path's over gloo, with prefix caching, chunked prefill and
    preemption at work (PROMPTS share a prefix; ENGINE's budget of 8 tokens chunks them). Gemma 3:
    its post-attention and post-MLP norms apply to the summed outputs."""
    if source.endswith("int8"):
        make_tiny_model("gemma3" if source.startswith("gemma3") else "llama", tmp_path)
        model, options = str(tmp_path), {"quantization": "int8"}
    else:
        kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd")
        model, options = str(tiny_llama_gguf(tmp_path, dict.fromkeys(kinds, Q.Q4_1), tokenizer=True)), {}
    tp = dict(tensor_parallel_size=2, threads_per_rank=1)
    ref_tokens, ref_lp, _ = _run(model, fused=True, **options)
    tp_tokens, tp_lp, _ = _run(model, fused=True, **tp, **options)
    monkeypatch.setenv("LLMSERVE_TP_TRANSPORT", "gloo")
    gloo_tokens, gloo_lp, _ = _run(model, fused=False, **tp, **options)
    assert tp_tokens == ref_tokens == gloo_tokens
    # q8/q4 activations are rounded per shard (see the GGUF test above): logprobs within 2e-3
    np.testing.assert_allclose(np.array(tp_lp), np.array(ref_lp), rtol=0, atol=2e-3)
    np.testing.assert_allclose(np.array(tp_lp), np.array(gloo_lp), rtol=0, atol=2e-3)


def test_refusals():
    """Sizes that do not divide the heads: ValueError before any worker starts."""
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size 2 does not divide the model's num_attention_heads \(9\)"
    ):
        build_engine(None, show_progress=False, tensor_parallel_size=2)  # embedded SmolLM2: 9 heads


def check_killed_worker_stops_the_engine(
    model: str, kill: Callable[[Any], str], fused: bool | None = None, **options
) -> None:
    """A TP=2 engine (`options`: its backend) whose worker `kill(executor.workers)` ends mid-run:
    the next steps raise `TensorParallelError` matching `kill`'s pattern within seconds, then
    every later step at once. `fused`: whether the driver must run the fused C++ decoder."""
    engine = build_engine(model, show_progress=False, tensor_parallel_size=2, threads_per_rank=1, **options)
    if fused is not None:
        assert (engine.runner.runner.fused is not None) == fused
    try:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        engine.add_request("a", [5, 17, 99, 3], params)
        engine.step()
        pattern = kill(engine.executor.workers)
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match=pattern):
            for _ in range(50):
                engine.step()
        assert time.monotonic() - started < 30
        with pytest.raises(TensorParallelError):  # and every later step, at once
            engine.step()
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("transport", "quantization"),
    [("shm", "none"), ("shm", "int8"), ("gloo", "none")],
    ids=["shm-layers", "shm-fused", "gloo-layers"],
)
def test_dead_worker_stops_the_engine(transport, quantization, tmp_path, monkeypatch):
    """Wherever the driver waits for the dead worker (a gloo collective, a shared-memory wait in
    the model's hooks or inside the fused C++ decoder), the step fails naming it, within seconds."""
    monkeypatch.setenv("LLMSERVE_TP_TRANSPORT", transport)

    def kill(workers) -> str:
        pid = workers.processes[0].pid
        os.kill(pid, signal.SIGKILL)
        return rf"worker rank 1 \(pid {pid}, exit code -9\) died"

    make_tiny_model("llama", tmp_path)
    check_killed_worker_stops_the_engine(
        str(tmp_path), kill, fused=quantization == "int8", quantization=quantization
    )


def test_worker_dead_before_joining_fails_start_up(tmp_path):
    """A worker killed while it starts: start-up names it within seconds (not the group's
    two-minute timeout)."""
    import threading

    import psutil

    make_tiny_model("llama", tmp_path)

    def kill_first_worker() -> None:
        me = psutil.Process()
        while not (kids := [p for p in me.children() if "spawn" in " ".join(p.cmdline())]):
            time.sleep(0.01)
        kids[0].kill()

    threading.Thread(target=kill_first_worker, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"worker rank 1 \(pid \d+, exit code -9\) died"):
        build_engine(str(tmp_path), show_progress=False, tensor_parallel_size=2, threads_per_rank=1)
    assert time.monotonic() - started < 60


def test_failed_worker_start_leaves_no_segment(tmp_path, monkeypatch):
    """Workers that cannot be started (here the process launch raises) fail start-up with that
    error and leave no shared-memory segment behind in /dev/shm."""
    from llmserve.distributed import shm
    from llmserve.model_executor import tp_executor

    if shm.transport() != "shm":
        pytest.skip("the C++ extension is not built")
    make_tiny_model("llama", tmp_path)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError("cannot start worker processes")

    monkeypatch.setattr(tp_executor, "ProcessWorkers", refuse)
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(OSError, match="cannot start worker processes"):
        build_engine(str(tmp_path), show_progress=False, tensor_parallel_size=2, threads_per_rank=1)
    assert not [f for f in set(os.listdir("/dev/shm")) - before if f.startswith("llmserve-tp-")]


@pytest.mark.slow
def test_embedded_smollm2_tp3_matches_tp1():
    """The embedded SmolLM2-135M (Q4_1 blocks; 9 heads, 3 KV heads: TP=3 splits it, TP=2 is
    refused above). Single-process it runs the fused C++ decoder, under TP the layers: logprobs
    moved by up to 8e-3 over 16 tokens (q4 activations rounded per shard, float16 KV cache)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)
    prompt = "The capital of France is"

    def run(**options):
        llm = LLM(show_progress=False, **options)
        try:
            out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        finally:
            llm.engine.close()
        return out.token_ids, [lp[t][0] for t, lp in zip(out.token_ids, out.logprobs, strict=True)]

    ref_tokens, ref_lp = run()
    tp_tokens, tp_lp = run(tensor_parallel_size=3, threads_per_rank=1)
    assert tp_tokens == ref_tokens
    np.testing.assert_allclose(tp_lp, ref_lp, rtol=0, atol=2e-2)
