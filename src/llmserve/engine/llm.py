"""`LLM`: the offline API. Give it prompts, get completions back, in order.

    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=32))
    outs = llm.chat([{"role": "user", "content": "Hi!"}])

All prompts are queued at once and run with in-flight batching; a progress bar shows finished
prompts and the running output throughput.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from llmserve.config import CacheConfig, ModelConfig, SchedulerConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams

Prompt = str | Sequence[int]
Message = dict[str, Any]


def build_engine(
    model: str | None = None,
    *,
    dtype: str = "auto",
    device: str = "auto",
    cpu_gemm: str = "auto",
    quantization: str = "auto",
    max_model_len: int | None = None,
    show_progress: bool = True,
    block_size: int = 16,
    kv_cache_memory: int | None = None,
    num_kv_blocks: int | None = None,
    enable_prefix_caching: bool = True,
    kv_cache_dtype: str = "auto",
    max_num_batched_tokens: int = 1024,
    max_num_seqs: int = 64,
    scheduling_policy: str = "fcfs",
    admission_policy: str = "optimistic",
    batching_mode: str = "continuous",
) -> LLMEngine:
    """An `LLMEngine` from flat options (the offline API's and the command line's)."""
    return LLMEngine(
        ModelConfig(
            model=model,
            dtype=dtype,
            device=device,
            cpu_gemm=cpu_gemm,
            quantization=quantization,
            max_model_len=max_model_len,
            show_progress=show_progress,
        ),  # type: ignore[arg-type]
        CacheConfig(
            block_size=block_size,
            kv_cache_memory=kv_cache_memory,
            num_kv_blocks=num_kv_blocks,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_dtype=kv_cache_dtype,
        ),
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            policy=scheduling_policy,  # type: ignore[arg-type]
            admission=admission_policy,  # type: ignore[arg-type]
            mode=batching_mode,  # type: ignore[arg-type]
        ),
    )


def _is_token_ids(x: object) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, int) for t in x)


class LLM:
    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        """`engine_options`: the keyword arguments of `build_engine` (dtype, device, cpu_gemm, quantization, max_model_len,
        block_size, kv_cache_memory, num_kv_blocks, enable_prefix_caching, kv_cache_dtype, max_num_batched_tokens,
        max_num_seqs, scheduling_policy, admission_policy, batching_mode, show_progress)."""
        self.engine = build_engine(model, **engine_options)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Completions for a prompt or a list of prompts (strings or token-id lists), in order."""
        if isinstance(prompts, str) or _is_token_ids(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        params = self._params_list(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompt_list)} prompts")
        return self._run(prompt_list, params, priority, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Completions of one conversation or a list of conversations, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts: list[Prompt] = []
        for conv in conversations:
            text = tokenizer.apply_chat_template(list(conv), add_generation_prompt=add_generation_prompt)
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        params = self._params_list(sampling_params, len(prompts))
        return self._run(prompts, params, None, use_tqdm)

    @staticmethod
    def _params_list(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {n} prompts")
        return list(sampling_params)

    def _run(
        self,
        prompts: list[Prompt],
        params: list[SamplingParams],
        priority: Sequence[int] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        engine = self.engine
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for i, (req_id, prompt, p) in enumerate(zip(ids, prompts, params, strict=True)):
                engine.add_request(req_id, prompt, p, priority=priority[i] if priority else 0)
        except ValueError as e:
            engine.abort_request(ids)  # nothing half-queued stays behind
            raise ValueError(f"prompt {i}: {e}") from None
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="prompt", disable=not use_tqdm)
        start, num_out = time.perf_counter(), 0
        with bar:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        num_out += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"{num_out / (time.perf_counter() - start):.1f} output tok/s")
        return [results[i] for i in ids]
