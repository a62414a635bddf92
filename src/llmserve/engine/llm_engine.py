"""`LLMEngine`: the synchronous engine: input processing, the core step, output processing.

    add_request: prompt -> token ids (chat template applied by the caller), checks, fan-out of n
    step():      scheduler.schedule() -> runner.execute_model() -> scheduler.update_from_output()
                 -> output processing (detokenize, stop strings, logprobs) -> RequestOutputs

The only place where the scheduler (core/) and the model runner (model_executor/) meet.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmserve.config import CacheConfig, ModelConfig, SchedulerConfig
from llmserve.config.lora import LoRAConfig
from llmserve.config.parallel import ParallelConfig
from llmserve.config.speculative import SpeculativeConfig
from llmserve.core.multimodal import MultiModalInput
from llmserve.core.request import Request, RequestStatus
from llmserve.core.sched_output import SchedulerOutput
from llmserve.core.scheduler import Scheduler, make_scheduler
from llmserve.engine.kv_sizing import encoder_blocks, size_kv_cache
from llmserve.engine.media_inputs import MediaInputs
from llmserve.engine.output_processor import OutputProcessor
from llmserve.errors import ParameterError
from llmserve.lora import LoRARequest, module_requests
from llmserve.lora.manager import LoRAManager
from llmserve.metrics.stats import IterationStats, SchedulerStats
from llmserve.model_executor.forward_runner import ForwardRunner, runs_fused_decoder
from llmserve.model_executor.model_loader import LoadedModel, load_model
from llmserve.model_executor.model_runner import ModelRunner
from llmserve.model_executor.pooler import default_pooling_params
from llmserve.model_executor.tp_executor import TPExecutor
from llmserve.multimodal.processor import ImageSource, PromptProcessor, make_prompt_processor
from llmserve.outputs import RequestOutput
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.controller import SpecController
from llmserve.spec_decode.draft import DraftModelProposer
from llmserve.spec_decode.ngram import NgramProposer
from llmserve.structured_output import StructuredOutputManager
from llmserve.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger("llmserve")


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    """A prompt that passed every check: what `add_request` queues."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    """Resolved output budget (max_tokens, or what the context leaves); 0 for an embedding."""
    pooling: PoolingParams | None = None
    """An embedding request: how its prompt is pooled (nothing is generated)."""
    mm_inputs: tuple[MultiModalInput, ...] = ()
    """Its images, placed in `token_ids` and preprocessed."""


# What an embedding request carries as sampling parameters: never used to sample (the runner
# pools it instead), but the output processing and the runner's states expect one.
_EMBEDDING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


class LLMEngine:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        loaded: LoadedModel | None = None,
        log_stats: bool = False,
        speculative_config: SpeculativeConfig | None = None,
        lora_config: LoRAConfig | None = None,
        parallel_config: ParallelConfig | None = None,
    ) -> None:
        """`log_stats`: keep each step's `IterationStats` until `take_stats()` collects them (a
        server's metrics); otherwise they are dropped at the next step. `speculative_config`:
        speculative decoding (config/speculative.py), off when None. `lora_config`: serve LoRA
        adapters (`add_request(..., lora_request=...)`), off when None. `parallel_config`: tensor
        parallelism (the model split over worker processes, model_executor/tp_executor.py)."""
        self.model_config = model_config
        self.cache_config = cache_config or CacheConfig()
        self.scheduler_config = scheduler_config or SchedulerConfig()
        self.speculative_config = speculative_config
        if speculative_config is not None and self.scheduler_config.is_static:
            raise ValueError(
                f"speculative decoding needs continuous batching; batching mode is {self.scheduler_config.mode!r}"
            )
        self.parallel_config = parallel_config or ParallelConfig()
        self.executor: TPExecutor | None = None
        if self.parallel_config.is_parallel:
            # Speculative decoding needs nothing of its own: a verification forward is a flat batch
            # like any other (tp_executor.py), and a draft model runs whole on the driver.
            if loaded is not None:
                raise ValueError("a tensor-parallel engine loads its shards itself; it takes no loaded model")
            self.executor = TPExecutor(model_config, self.parallel_config)
            loaded = self.executor.loaded
        self.loaded = loaded or load_model(model_config)
        if self.loaded.model_impl == "transformers" and self.cache_config.enable_prefix_caching:
            # transformers' caches live per request, not in the shared blocks a prefix hit reuses
            logger.info("prefix caching is off: the transformers implementation keeps no shared KV blocks")
            self.cache_config = dataclasses.replace(self.cache_config, enable_prefix_caching=False)
        self.tokenizer: Tokenizer = load_tokenizer(self.loaded.source)
        if self.loaded.gguf_vision is not None:  # the image placeholder a GGUF vocabulary lacks
            self.tokenizer.add_special_tokens(self.loaded.gguf_vision.added_tokens)
        self.max_model_len = self.loaded.max_model_len
        # the step budget of the path the stack runs on (unless given)
        fused = self.loaded.model_impl == "native" and runs_fused_decoder(
            self.loaded.model, self.loaded.profile
        )
        self.scheduler_config = self.scheduler_config.for_model(fused)
        text_config = self.loaded.text_config  # a multimodal checkpoint: its language model's
        self.vocab_size = int(text_config.vocab_size)
        self.hidden_size = self.loaded.embedding_size  # (of the pooled vectors, after any Dense layers)
        self.images = self._image_processor()
        """Prompts with images (None: the model takes none)."""
        self.media = MediaInputs(
            self.images, self.loaded.source.name, bool(getattr(self.loaded.model, "bidirectional_images", False)),
            self.loaded.profile.attention_backend, self.scheduler_config.token_budget,
        )  # fmt: skip
        source = self.loaded.source
        self.default_pooling = default_pooling_params(
            model_config.pooling,
            model_config.normalize_embeddings,
            source.path if source.kind == "hf" else None,
            getattr(self.loaded.hf_config, "gguf_pooling", None),
        )
        """Embedding requests' pooling when they name none (config/model.py `pooling`)."""

        self.is_encoder = getattr(self.loaded.model, "is_encoder", False)
        """An encoder-only model (BERT): embeddings only, each sequence run whole, no KV cache."""
        self.embedding_only = self.is_encoder or getattr(self.loaded.model, "pooling_only", False)
        """No generation: an encoder, or a decoder stack saved without its LM head (Qwen3-Embedding)."""
        self.is_classifier = hasattr(self.loaded.model, "score_head")
        """A sequence classifier (models/bert.py `CrossEncoder`): its pooled output is its head's
        scores or label probabilities, not an embedding (engine/scoring.py)."""
        self.classifier_labels: list[str] = list(getattr(self.loaded.model, "labels", []))
        self.is_cross_encoder = self.is_classifier and len(self.classifier_labels) == 1
        """A one-label classifier: a cross-encoder (reranker) that scores text pairs."""
        if self.is_classifier:  # its head's pooling: the first token's, or the mean (ModernBERT's "mean")
            own = getattr(self.loaded.model, "classifier_pooling", "cls")
            if model_config.pooling not in ("auto", own):
                raise ValueError(f"{type(self.loaded.model).__name__} scores from its {own!r} pooling: pooling "
                                 f"must be 'auto' or {own!r}; got {model_config.pooling!r}")  # fmt: skip
            self.default_pooling = PoolingParams(own, normalize=False)
        if self.is_encoder:
            self._check_encoder(speculative_config, lora_config)
        k = speculative_config.num_speculative_tokens if speculative_config is not None else 0
        sched = self.scheduler_config
        max_num_tokens = sched.token_budget + k * sched.max_num_seqs
        kv_dtype = self.loaded.kv_cache_dtype(self.cache_config.kv_cache_dtype)
        draft = None  # a draft model is loaded first: its KV cache shares the target's budget
        if speculative_config is not None and speculative_config.method == "draft_model":
            assert speculative_config.model is not None
            draft = DraftModelProposer.load(
                speculative_config.model, self.loaded, speculative_config.quantization
            )
        if self.is_encoder:
            self.kv_info = encoder_blocks(self.cache_config, sched.max_num_seqs, self.max_model_len)
        else:
            self.kv_info = size_kv_cache(
                self.loaded,
                self.cache_config,
                sched.max_num_seqs,
                self.max_model_len,
                kv_dtype,
                max_num_tokens,
                draft,
            )
        num_blocks = self.kv_info.num_blocks
        logger.info(self.kv_info.summary())

        self.scheduler: Scheduler = make_scheduler(
            self.scheduler_config, self.cache_config, num_blocks, self.max_model_len, k,
            None if lora_config is None else lora_config.max_loras, chunked_prefill=not self.is_encoder,
        )  # fmt: skip
        self.proposer: NgramProposer | DraftModelProposer | None = None
        if draft is not None:
            assert speculative_config is not None and speculative_config.model is not None
            self.proposer = DraftModelProposer(
                speculative_config.model,
                draft,
                num_blocks,
                self.cache_config.block_size,
                kv_dtype,
            )
        elif speculative_config is not None:
            self.proposer = NgramProposer(speculative_config)
        self.controller = (
            SpecController(k, self.loaded.profile.kind, speculative_config.adaptive)
            if speculative_config is not None
            else None
        )
        self.structured_outputs = StructuredOutputManager(
            self.tokenizer, self.vocab_size, self.tokenizer.eos_token_ids
        )
        runner_sizes = dict(
            num_blocks=num_blocks, block_size=self.cache_config.block_size, kv_cache_dtype=kv_dtype,
            max_num_tokens=max_num_tokens, max_num_seqs=sched.max_num_seqs, max_model_len=self.max_model_len,
        )  # fmt: skip
        self.runner = ModelRunner(
            self.loaded.model,
            num_blocks,
            self.cache_config.block_size,
            self.vocab_size,
            kv_dtype,
            self.structured_outputs,
            self.loaded.profile,
            max_num_tokens=max_num_tokens,
            max_num_seqs=sched.max_num_seqs,
            max_model_len=self.max_model_len,
            forward_runner=None if self.executor is None else self.executor.init_runner(**runner_sizes),
        )
        self.lora: LoRAManager | None = None
        if lora_config is not None:
            if not isinstance(self.runner.runner, ForwardRunner):
                raise ValueError("LoRA adapters need the native model implementation (model_impl native)")
            self.lora = (
                LoRAManager(self.loaded.model, lora_config)
                if self.executor is None
                else self.executor.lora_manager(lora_config)
            )
            self.runner.runner.use_lora(self.lora)
            for request in module_requests(lora_config):  # a bad folder fails start-up
                self.lora.add(request)
        if self.loaded.profile.cuda_graphs and not self.is_encoder:
            self.runner.capture_cuda_graphs(
                sched.max_num_seqs, self.max_model_len, model_config.show_progress
            )
        if self.runner.device.type == "cuda" and not self.is_encoder:
            self.runner.warm_up_sampler()
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler_config.stream_interval)
        self.last_stats: SchedulerStats | None = None
        self.log_stats = log_stats
        self._stats = IterationStats(time.monotonic())

    def _check_encoder(
        self, speculative_config: SpeculativeConfig | None, lora_config: LoRAConfig | None
    ) -> None:
        """What an encoder cannot run, refused at start-up; prefix caching turned off (a token's
        state depends on the tokens after it, so no prefix is ever shared)."""
        name = type(self.loaded.model).__name__
        if self.scheduler_config.is_static:
            raise ValueError(
                f"{name} serves embeddings, which need continuous batching; mode is {self.scheduler_config.mode!r}"
            )
        if speculative_config is not None or lora_config is not None:
            raise ValueError(
                f"{name} serves embeddings only: speculative decoding and LoRA adapters do not apply"
            )
        budget = self.scheduler_config.token_budget
        if budget < self.max_model_len:
            raise ValueError(
                f"{name} runs each input whole in one step: max_num_batched_tokens ({budget}) must be >= "
                f"max_model_len ({self.max_model_len})"
            )
        if self.cache_config.enable_prefix_caching:
            self.cache_config = dataclasses.replace(self.cache_config, enable_prefix_caching=False)

    # -- input processing ------------------------------------------------------------------------

    def _image_processor(self) -> PromptProcessor | None:
        model = self.loaded.model
        if not getattr(model, "supports_images", False):
            return None
        source, vision = self.loaded.source, self.loaded.gguf_vision
        return make_prompt_processor(
            model,
            self.loaded.hf_config,
            self.tokenizer.id_to_token,
            ImageSource(
                source.path if source.kind == "hf" else None,
                vision.preprocessing if vision is not None else None,
                self.model_config.do_pan_and_scan,
                self.model_config.max_video_frames,
                self.model_config.max_video_pixels,
            ),
        )

    def encode_prompt(
        self, prompt: str | Sequence[int], add_special_tokens: bool = True
    ) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        ids = list(prompt)
        if not ids:
            raise ParameterError("prompt token ids must not be empty", param="prompt")
        bad = [
            t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size
        ]
        if bad:
            raise ParameterError(
                f"prompt token id(s) {bad[:5]} outside the vocabulary (size {self.vocab_size})",
                param="prompt",
            )
        return None, ids

    def process_inputs(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        images: Sequence[Any] = (),
        add_special_tokens: bool = True,
        videos: Sequence[Any] = (),
    ) -> ProcessedPrompt:
        """Tokenize and check a prompt against the model; raises ValueError, changes nothing.
        `images` (encoded bytes or PIL images): one per image marker of the text prompt (Gemma 3's
        `<start_of_image>`, Qwen2.5-VL's `<|image_pad|>`: what their chat templates write for each
        image part). `videos` (Qwen2-VL / Qwen2.5-VL: frames, or a `Video` with its fps): one per
        `<|video_pad|>`.
        `add_special_tokens`: False for a rendered chat template (it holds them already).

        Safe to call from another thread than the one that runs `step()`.
        """
        if self.embedding_only:
            raise ParameterError(self.embedding_only_message(), param="model")
        prompt, place = self.media.expand(prompt, images, videos)
        text, ids = self.encode_prompt(prompt, add_special_tokens)
        mm_inputs = place(ids)
        if not ids:
            raise ParameterError("the prompt is empty after tokenization", param="prompt")
        params.validate_for_model(self.vocab_size)
        if params.structured_outputs is not None:
            self.structured_outputs.compile(params.structured_outputs)  # ParameterError when invalid
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if len(ids) + max(max_tokens, 1) > self.max_model_len:
            raise ParameterError(
                f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds the model's context of "
                f"{self.max_model_len} tokens",
                param="max_tokens" if params.max_tokens is not None else "prompt",
            )
        return ProcessedPrompt(text, ids, params, max_tokens, mm_inputs=mm_inputs)

    def embedding_only_message(self, api: str = "text generation") -> str:
        """Why an embedding-only model refuses a request of `api` (vLLM: "does not support ... API"),
        and the routes it serves: a classifier's (engine/scoring.py), or embeddings."""
        routes, kind = "its inputs to /v1/embeddings (LLM.embed)", "an embedding model"
        if self.is_cross_encoder:
            routes = "text pairs to /v1/score or /v1/rerank (LLM.score), or texts to /classify (LLM.classify)"
            kind = "a cross-encoder"
        elif self.is_classifier:
            routes, kind = (
                "texts to /classify (LLM.classify)",
                f"a classifier of {len(self.classifier_labels)} labels",
            )
        elif not self.is_encoder:
            kind += " (a decoder without an LM head)"
        name = f"{self.loaded.source.name!r} ({type(self.loaded.model).__name__})"
        return f"model {name} is {kind}: it does not support {api}; send {routes}"

    def process_embedding_inputs(
        self, prompt: str | Sequence[int], pooling: PoolingParams | None = None
    ) -> ProcessedPrompt:
        """Tokenize and check an embedding input (`pooling`: the engine's default when None);
        raises ValueError, changes nothing. Safe to call from another thread than `step()`'s."""
        if self.loaded.model_impl == "transformers" or self.scheduler_config.is_static:
            raise ParameterError(
                "embeddings need the native model implementation and continuous batching", param="input"
            )
        if self.is_classifier:
            raise ParameterError(self.embedding_only_message("embeddings"), param="model")
        text, ids = self.encode_prompt(prompt)
        return self.pooled_prompt(text, ids, pooling or self.default_pooling)

    def pooled_prompt(self, text: str | None, ids: list[int], pooling: PoolingParams) -> ProcessedPrompt:
        """A pooling input (embedding, score, classification) checked against the context."""
        if not ids:
            raise ParameterError("the input is empty after tokenization", param="input")
        if len(ids) > self.max_model_len:
            raise ParameterError(
                f"input of {len(ids)} tokens exceeds the model's context of {self.max_model_len} tokens",
                param="input",
            )
        pooling.validate_for_model(self.hidden_size)
        return ProcessedPrompt(text, ids, _EMBEDDING_SAMPLING, 0, pooling)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | ProcessedPrompt,
        params: SamplingParams | None = None,
        priority: int = 0,
        delta: bool = False,
        lora_request: LoRARequest | None = None,
        final_only: bool = False,
    ) -> None:
        """Validate and queue a request; raises ValueError (nothing queued) for bad input.

        `prompt` may be the result of `process_inputs`. `delta`: each step's output for this
        request carries only the new tokens and text (streaming); otherwise it accumulates.
        `final_only`: `step` returns this request's output only once, when it finishes.
        `lora_request`: the adapter it runs with (loaded now the first time, so a bad one fails here).
        """
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_request is not None:
            if self.lora is None:
                raise ValueError(
                    f"request {request_id!r} names LoRA adapter {lora_request.lora_name!r}; LoRA is off (enable_lora)"
                )
            self.lora.add(lora_request, self._loras_in_use())
        if not isinstance(prompt, ProcessedPrompt):
            assert params is not None, "add_request needs sampling params with a raw prompt"
            prompt = self.process_inputs(prompt, params)
        params, ids = prompt.params, prompt.token_ids
        arrival = time.monotonic()
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        self.output_processor.add_request(
            request_id,
            prompt.text,
            ids,
            params,
            child_ids,
            arrival,
            delta,
            prompt.max_tokens,
            None if lora_request is None else lora_request.lora_name,
            final_only,
        )
        for i, child_id in enumerate(child_ids):
            child_params = params
            if params.n > 1:
                # Each sample is its own request; n seeded samples must differ, and only the
                # first needs the (shared) prompt logprobs.
                child_params = dataclasses.replace(
                    params,
                    n=1,
                    seed=None if params.seed is None else (params.seed + i) % 2**63,
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None,
                )
            self.scheduler.add_request(
                Request(
                    request_id=child_id,
                    prompt_token_ids=ids,
                    sampling_params=child_params,
                    eos_token_ids=self.tokenizer.eos_token_ids,
                    priority=priority,
                    arrival_time=arrival,
                    max_tokens=prompt.max_tokens,
                    pooling_params=prompt.pooling,
                    lora_id=0 if lora_request is None else lora_request.lora_int_id,
                    mm_inputs=prompt.mm_inputs,
                )
            )

    def abort_request(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        """Abort requests now: their KV blocks are freed immediately."""
        outputs = []
        for request_id in request_ids:
            self.scheduler.finish_requests(self.output_processor.child_ids(request_id))
            out = self.output_processor.abort_request(request_id, self._stats)
            if out is not None:
                outputs.append(out)
        self._trim_loras()
        if outputs and self.log_stats:
            # Fresh gauges with the aborts: when they leave the engine idle, no step follows to
            # publish them, and running/KV-usage gauges would keep the last step's values.
            self._stats.scheduler = self._scheduler_stats()
        return outputs

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do for a single-process engine)."""
        if self.executor is not None:
            self.executor.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- LoRA adapters at run time (vLLM's add_lora / remove_lora / list_loras) -----------------

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter now (ValueError naming the file and the tensor when it is
        bad); requests may then name it."""
        if self.lora is None:
            raise ValueError(
                f"cannot load LoRA adapter {lora_request.lora_name!r}: LoRA is off (enable_lora)"
            )
        self.lora.add(lora_request, self._loras_in_use())

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter (False: it was not loaded). Requests already running or waiting with
        it finish with it; its weights are dropped after the last one ends."""
        return self.lora is not None and self.lora.remove(lora_id, self._loras_in_use())

    def list_loras(self) -> set[int]:
        """Ids of the adapters requests may name."""
        return set() if self.lora is None else set(self.lora.requests)

    def _scheduler_stats(self, step_tokens: int = 0) -> SchedulerStats:
        """The scheduler's record, its LoRA adapters named."""
        return self.scheduler.stats(step_tokens, None if self.lora is None else self.lora.names)

    def _loras_in_use(self) -> set[int]:
        """The adapters of unfinished requests (waiting or running)."""
        return {r.lora_id for r in self.scheduler.requests.values() if r.lora_id}

    def _trim_loras(self) -> None:
        """Drop the adapter weights that requests ending has freed (removed, or over max_cpu_loras)."""
        if self.lora is not None and self.lora.needs_trim:
            self.lora.trim(self._loras_in_use())

    # -- one step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of requests that progressed (finished or not)."""
        step_started = time.perf_counter()
        if self.executor is not None:
            self.executor.check()  # a dead rank fails every step from then on, before scheduling
        if not self.log_stats:  # nobody collects them: keep only this step's
            self._stats = IterationStats(0.0)
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.scheduled_new_reqs:
            self.output_processor.mark_scheduled(
                [r.req_id for r in scheduler_output.scheduled_new_reqs], time.monotonic()
            )
        runner_output = self.runner.execute_model(scheduler_output)
        sched = self.scheduler
        accepted, proposed = sched.spec_num_accepted_tokens, sched.spec_num_draft_tokens
        core_outputs = sched.update_from_output(scheduler_output, runner_output)
        if self.controller is not None and scheduler_output.scheduled_spec_tokens:
            self.controller.observe_acceptance(
                sched.spec_num_accepted_tokens - accepted, sched.spec_num_draft_tokens - proposed
            )
        stats = self._stats
        stats.timestamp = time.monotonic()
        stats.step_seconds = time.perf_counter() - step_started
        outputs, stopped = self.output_processor.process_outputs(core_outputs, stats)
        if stopped:  # stop strings found by the detokenizer end those requests in the scheduler too
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self._trim_loras()
        self.last_stats = stats.scheduler = self._scheduler_stats(scheduler_output.total_num_scheduled_tokens)
        if self.proposer is not None:
            self._propose()
        if self.controller is not None and self._decode_only(scheduler_output):
            # the whole step, scheduling and output handling included: tokens per second is what
            # the controller weighs, and that per-step time is part of every step's cost
            self.controller.observe_step(
                scheduler_output.total_num_scheduled_tokens, time.perf_counter() - step_started
            )
        return outputs

    def _propose(self) -> None:
        """Proposals for the decoding requests of the next step (speculative decoding), cut to
        what pays for itself (spec_decode/controller.py); all decode plainly while the batch is at
        `disable_by_batch_size`. A grammar's requests speculate too: the runner verifies only the
        proposals the grammar allows."""
        spec, proposer, controller = self.speculative_config, self.proposer, self.controller
        assert spec is not None and proposer is not None and controller is not None
        running = self.scheduler.running
        proposer.retain(self.scheduler.requests)
        if spec.disable_by_batch_size is not None and len(running) >= spec.disable_by_batch_size:
            return
        decoding: list[Request] = []
        num_tokens = 0
        for request in running:
            remaining = request.num_tokens - request.num_computed_tokens
            num_tokens += remaining
            if remaining == 1 and request.pooling_params is None:  # decoding (not prefilling)
                request.spec_idle += 1
                decoding.append(request)
        # requests whose proposals keep failing are not even asked
        asked = [r for r in decoding if controller.worth_proposing(r, num_tokens, len(decoding))]
        if not asked:
            return
        offers = proposer.propose_batch(asked, spec.num_speculative_tokens)
        candidates = [(r, len(offers[r.request_id])) for r in asked if offers.get(r.request_id)]
        if not candidates:
            return
        for request_id, k in controller.allocate(candidates, num_tokens, len(decoding)).items():
            self.scheduler.requests[request_id].spec_token_ids = offers[request_id][:k]

    @staticmethod
    def _decode_only(so: SchedulerOutput) -> bool:
        """Whether every request of the step was decoding (its time then fits the cost model)."""
        if so.scheduled_new_reqs:
            return False
        spec = so.scheduled_spec_tokens
        return all(n == 1 + len(spec.get(rid, ())) for rid, n in so.num_scheduled_tokens.items())

    def take_stats(self) -> IterationStats | None:
        """The statistics gathered since the last call (steps and aborts); None when nothing
        happened. With several steps in between, only the last step's gauges are kept."""
        stats = self._stats
        if stats.is_empty:
            return None
        self._stats = IterationStats(time.monotonic())
        return stats

    def kv_waste(self) -> float:
        """Fraction of allocated KV slots that hold no token right now (0 when nothing is allocated)."""
        allocated, stored = self.scheduler.kv_cache_manager.waste()
        return 0.0 if allocated == 0 else 1.0 - stored / allocated
