"""`LLM`: the offline API. Give it prompts, get completions back, in order.

    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=32))
    outs = llm.chat([{"role": "user", "content": "Hi!"}])
    vecs = llm.embed(["Hello", "The sky is"])     # pooled final hidden states (--pooling)

All prompts are queued at once and run with in-flight batching; a progress bar shows finished
prompts and the running output throughput.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from llmserve.config.engine_args import EngineArgs
from llmserve.engine.llm_engine import LLMEngine, ProcessedPrompt
from llmserve.engine.scoring import classify_input, pair_texts, plan_scores
from llmserve.errors import ParameterError
from llmserve.lora import LoRARequest
from llmserve.multimodal.qwen_vl_video import videos_of
from llmserve.outputs import ClassificationOutput, EmbeddingOutput, RequestOutput, ScoreOutput
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import SamplingParams

Prompt = str | Sequence[int]
# vLLM's prompt forms: a string, token ids, or a dict {"prompt": str} / {"prompt_token_ids": [...]}
PromptInput = Prompt | dict[str, Any]
_PROMPT_KEYS = ("prompt", "prompt_token_ids")
Message = dict[str, Any]


def build_engine(model: str | None = None, **options: Any) -> LLMEngine:
    """An `LLMEngine` from flat options: the names of `EngineArgs` (dtype, device, quantization,
    kv_cache_memory, max_num_seqs, ...), with the values the command line takes (sizes as "4GiB",
    numbers as text); a bad one is a `ValueError` naming it."""
    return engine_from_args(EngineArgs.from_options({"model": model, **options}, "LLM"))


def engine_from_args(args: EngineArgs) -> LLMEngine:
    model, cache, scheduler, speculative = args.configs()
    return LLMEngine(
        model, cache, scheduler, speculative_config=speculative, lora_config=args.lora_config(),
        parallel_config=args.parallel_config(),
    )  # fmt: skip


def _is_token_ids(x: object) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, int) for t in x)


def _is_single_prompt(x: object) -> bool:
    return isinstance(x, (str, dict)) or _is_token_ids(x)


@dataclass(frozen=True, slots=True)
class ImagePrompt:
    """A text prompt with images and videos (vLLM's {"prompt": ..., "multi_modal_data":
    {"image": ..., "video": ...}})."""

    prompt: str
    images: tuple[Any, ...]
    videos: tuple[Any, ...] = ()


def _media_of(data: object, index: int) -> ImagePrompt:
    """`multi_modal_data` -> its images (one image or a list; PIL images or encoded bytes) and
    videos (multimodal/qwen_vl_video.py's `videos_of`), with an empty prompt."""
    if not isinstance(data, dict) or not data or not set(data) <= {"image", "video"}:
        raise ValueError(
            f"prompt {index}: 'multi_modal_data' must be a dict with keys 'image' and/or 'video'"
        )
    images = data.get("image", ())
    images = tuple(images) if isinstance(images, (list, tuple)) else (images,)
    try:
        videos = videos_of(data["video"]) if "video" in data else ()
    except ValueError as e:
        raise ValueError(f"prompt {index}: {e}") from None
    if not images and not videos:
        raise ValueError(f"prompt {index}: 'multi_modal_data' has no image or video")
    return ImagePrompt("", images, videos)


def to_prompt(x: object, index: int) -> Prompt | ImagePrompt:
    """One of vLLM's prompt forms as a string or a token-id list (with images: an `ImagePrompt`);
    ValueError naming the prompt otherwise. A dict holds exactly one of "prompt" (text) and
    "prompt_token_ids", and maybe "multi_modal_data" (with a text prompt)."""
    if isinstance(x, dict) and "multi_modal_data" in x:
        rest = {k: v for k, v in x.items() if k != "multi_modal_data"}
        text = to_prompt(rest, index)
        if not isinstance(text, str):
            raise ValueError(f"prompt {index}: a prompt with 'multi_modal_data' must be text ('prompt')")
        return dataclasses.replace(_media_of(x["multi_modal_data"], index), prompt=text)
    if isinstance(x, dict):
        keys = [k for k in _PROMPT_KEYS if k in x]
        extra = sorted(str(k) for k in x if k not in _PROMPT_KEYS)
        if len(keys) != 1 or extra:
            raise ValueError(
                f"prompt {index}: a dict prompt needs exactly one of 'prompt' or 'prompt_token_ids'"
                + (f" and no other keys (got {extra})" if extra else f" (got keys {sorted(map(str, x))})")
            )
        x = x[keys[0]]
        if keys[0] == "prompt_token_ids" and not _is_token_ids(x):
            raise ValueError(
                f"prompt {index}: 'prompt_token_ids' must be a non-empty list of ints; got {x!r:.80}"
            )
        if keys[0] == "prompt" and not isinstance(x, str):
            raise ValueError(f"prompt {index}: 'prompt' must be a string; got {type(x).__name__}")
    if isinstance(x, str) or _is_token_ids(x):
        return x  # type: ignore[return-value]
    raise ValueError(
        f"prompt {index}: expected a string, a list of token ids, or a dict with 'prompt' or "
        f"'prompt_token_ids'; got {type(x).__name__} {x!r:.80}"
    )


def _text_or_ids(x: object, index: int) -> Prompt:
    prompt = to_prompt(x, index)
    if isinstance(prompt, ImagePrompt):
        raise ValueError(f"prompt {index}: embeddings take no images")
    return prompt


class LLM:
    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        """`engine_options`: the fields of `EngineArgs` (dtype, device, cpu_gemm, quantization,
        cpu_activations, max_model_len, block_size, kv_cache_memory, num_kv_blocks,
        enable_prefix_caching, kv_cache_dtype, max_num_batched_tokens, max_num_seqs,
        scheduling_policy, admission_policy, batching_mode, model_impl, speculative_config,
        show_progress, hf_overrides, enable_lora, max_loras, max_lora_rank, max_cpu_loras, lora_dtype, tensor_parallel_size,
        distributed_executor_backend, threads_per_rank, ray_placement_strategy), with the command
        line's values: `kv_cache_memory="4GiB"` as `--kv-cache-memory 4GiB`. `speculative_config`: vLLM's dict (or its JSON), e.g.
        {"method": "ngram", "num_speculative_tokens": 4}."""
        self.engine = build_engine(model, **engine_options)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Completions for a prompt or a list of prompts, in order. A prompt is a string, a list
        of token ids, or (vLLM's forms) {"prompt": text} or {"prompt_token_ids": ids}; a model that
        takes images takes {"prompt": text, "multi_modal_data": {"image": a PIL image or a list}},
        the text holding one image marker per image (Gemma 3: `<start_of_image>`; Qwen2-VL and
        Qwen2.5-VL: `<|vision_start|><|image_pad|><|vision_end|>`); Qwen2-VL and Qwen2.5-VL take
        videos too, {"video": frames} (a list of PIL images or a [T, H, W, 3] uint8 array, or
        (frames, {"fps": ...}); several: a list), one `<|vision_start|><|video_pad|><|vision_end|>`
        each.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base
        model); the engine needs `enable_lora=True`."""
        if _is_single_prompt(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(prompts, Iterable):
            raise ValueError(f"prompts must be a prompt or a list of prompts; got {type(prompts).__name__}")
        prompt_list = [to_prompt(p, i) for i, p in enumerate(prompts)]
        params = self._params_list(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompt_list)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompt_list)
        elif len(lora_request) != len(prompt_list):
            raise ValueError(f"lora_request has {len(lora_request)} entries for {len(prompt_list)} prompts")
        else:
            loras = list(lora_request)
        return self._run(prompt_list, params, priority, use_tqdm, loras)

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

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingOutput]:
        """One embedding per prompt, in order (vLLM's `LLM.embed`): the prompt's final hidden
        states pooled as `pooling_params` says (default: the engine's, `pooling` /
        `normalize_embeddings`). Prompts take the forms `generate` takes."""
        if _is_single_prompt(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        inputs = []
        for i, p in enumerate(prompts):  # type: ignore[arg-type]
            try:  # every prompt checked before any is queued
                inputs.append(self.engine.process_embedding_inputs(_text_or_ids(p, i), pooling_params))
            except ValueError as e:
                raise ParameterError(f"prompt {i}: {e}", param=getattr(e, "param", None)) from None
        return self._pooled(inputs, "Embedding", use_tqdm)

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoreOutput]:
        """Scores of text pairs (vLLM's `LLM.score`): one `text_1` against each `text_2`, or the
        two lists side by side. A cross-encoder (reranker) scores each pair as one input; any
        other model gives the cosine similarity of the two texts' embeddings
        (engine/scoring.py). `truncate_prompt_tokens` (vLLM's): inputs keep at most this many
        tokens (-1: the context; a pair loses tokens from its longer text first); None: an input
        over the context is a ValueError."""
        plan = plan_scores(self.engine, pair_texts(text_1, text_2), truncate_prompt_tokens)
        outs = self._pooled(plan.inputs, "Scoring", use_tqdm)
        scores = plan.scores([o.embedding for o in outs])
        return [ScoreOutput(x, ids) for x, ids in zip(scores, plan.pair_token_ids(), strict=True)]

    def classify(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationOutput]:
        """Each prompt's label probabilities and most likely label (vLLM's `LLM.classify`), from a
        sequence classifier (`...ForSequenceClassification`); prompts take the forms `generate`
        takes, `truncate_prompt_tokens` as in `score`."""
        if _is_single_prompt(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        engine, inputs = self.engine, []
        for i, p in enumerate(prompts):  # type: ignore[arg-type]
            try:
                inputs.append(classify_input(engine, _text_or_ids(p, i), truncate_prompt_tokens))
            except ValueError as e:
                raise ParameterError(f"prompt {i}: {e}", param=getattr(e, "param", None)) from None
        labels = engine.classifier_labels
        return [
            ClassificationOutput(o.embedding, labels[max(range(len(o.embedding)), key=o.embedding.__getitem__)],
                                 o.prompt_token_ids)
            for o in self._pooled(inputs, "Classifying", use_tqdm)
        ]  # fmt: skip

    def _pooled(self, inputs: list[ProcessedPrompt], desc: str, use_tqdm: bool) -> list[EmbeddingOutput]:
        """Run checked pooling inputs (embeddings, scores) to the end; their outputs in order."""
        engine = self.engine
        ids = [f"offline-{next(self._ids)}" for _ in inputs]
        for req_id, processed in zip(ids, inputs, strict=True):
            engine.add_request(req_id, processed, final_only=True)
        results: dict[str, EmbeddingOutput] = {}
        with tqdm(total=len(ids), desc=desc, unit="prompt", disable=not use_tqdm) as bar:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        assert out.embedding is not None, out.request_id
                        results[out.request_id] = EmbeddingOutput(out.embedding, out.prompt_token_ids)
                        bar.update(1)
        return [results[i] for i in ids]

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
        prompts: Sequence[Prompt | ImagePrompt],
        params: list[SamplingParams],
        priority: Sequence[int] | None,
        use_tqdm: bool,
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        engine = self.engine
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for i, (req_id, prompt, p) in enumerate(zip(ids, prompts, params, strict=True)):
                lora = loras[i] if loras else None
                if isinstance(prompt, ImagePrompt):
                    prompt = engine.process_inputs(prompt.prompt, p, prompt.images, videos=prompt.videos)
                engine.add_request(
                    req_id,
                    prompt,
                    p,
                    priority=priority[i] if priority else 0,
                    lora_request=lora,
                    final_only=True,
                )
        except ValueError as e:
            engine.abort_request(ids)  # nothing half-queued stays behind
            raise ParameterError(f"prompt {i}: {e}", param=getattr(e, "param", None)) from None
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
