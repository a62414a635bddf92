"""`ModelRunner` (vLLM's name for it): what the engine drives with the scheduler's decisions,
`execute_model(SchedulerOutput) -> ModelRunnerOutput`, one forward pass (through the
`ForwardRunner` it owns, which holds the KV cache) and the sampling after it. It keeps one `CachedRequestState` per live
request (token ids, block table, progress, sampling state) so the scheduler only sends what
changed, and per step:

  1. drops finished requests (and the blocks of preempted ones, keeping their sampling state);
  2. registers new requests and extends the block tables of running ones;
  3. flattens every scheduled chunk into one batch and runs the model once;
  4. projects to the vocabulary only the rows that are needed: the last position of each request
     whose known tokens are now all computed (it samples), and the prompt positions of requests
     that asked for prompt logprobs;
  5. masks the logits of requests with structured outputs to what their grammar allows next (the
     masks are computed on a worker thread while the forward pass runs, where a core is free for
     it), samples all requests together, then appends the tokens to their states (and grammars);
  6. an embedding request (a `pooling_params` one) is never sampled: its rows feed its pooling
     accumulator (pooler.py), and the step that runs its last prompt token returns its vector;
  7. with speculative decoding, a request that carries proposed tokens runs its last token and the
     proposals in one go, and verification (sample/rejection.py) keeps the proposals the
     model agrees with and adds the model's next token (with a grammar: only the proposals it
     allows are verified, each row masked by the grammar state after the ones before).
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from llmserve.core.sched_output import Logprobs, ModelRunnerOutput, NewRequestData, SchedulerOutput
from llmserve.model_executor.device import DeviceProfile, build_profile
from llmserve.model_executor.encoder_runner import EncoderForwardRunner
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.image_inputs import RequestImages, RopePositions
from llmserve.model_executor.pooler import PoolingState, finish
from llmserve.model_executor.transformers_runner import TransformersCausalLM, TransformersForwardRunner
from llmserve.models import CausalLM
from llmserve.sample import RequestSamplingState, Sampler, SamplingMetadata, compute_logprobs, make_generator
from llmserve.sample.philox import philox_exponentials_
from llmserve.sample.rejection import verify_proposals
from llmserve.structured_output import StructuredOutputManager, apply_bitmask, bitmask_words, to_device_async

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling: RequestSamplingState
    """Holds `output_token_ids` (the list the sampler reads for penalties) and the generator."""
    num_prompt_logprobs: int = 0
    """Prompt positions whose logprobs were already returned (a preempted request recomputes
    its prompt, but must not return them twice)."""
    pooler: PoolingState | None = None
    """An embedding request's accumulator (fresh after a preemption: the prompt is recomputed)."""
    lora_id: int = 0
    """Its LoRA adapter (0: the base model)."""
    images: RequestImages | None = None
    """Its images (image_inputs.py): encoded when a chunk reaches them."""
    rope: RopePositions | None = None
    """Its M-RoPE positions, for a model with three position ids a token and a prompt with images
    (None: its sequence positions, on every axis)."""

    def rope_slice(self, start: int, end: int) -> np.ndarray | None:
        return None if self.rope is None else self.rope.slice(start, end)

    @property
    def output_token_ids(self) -> list[int]:
        return self.sampling.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.sampling.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        P = len(self.prompt_token_ids)
        if end <= P:
            return self.prompt_token_ids[start:end]
        out = self.sampling.output_token_ids
        return self.prompt_token_ids[start:P] + out[max(start - P, 0) : end - P]


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        vocab_size: int,
        kv_cache_dtype: torch.dtype | None = None,
        structured_outputs: StructuredOutputManager | None = None,
        profile: DeviceProfile | None = None,
        max_num_tokens: int = 256,
        max_num_seqs: int = 16,
        max_model_len: int | None = None,
        forward_runner: ForwardRunner | None = None,
    ) -> None:
        """`structured_outputs`: makes the grammar state of requests that constrain their output.
        `profile`: the device's decisions (default: built for the model's device); the sizes are
        the scheduler's limits, which size the runner's input buffers. `forward_runner`: one
        already built for `model` with these sizes (a tensor-parallel driver's)."""
        self.runner: ForwardRunner | TransformersForwardRunner | EncoderForwardRunner
        if forward_runner is not None:
            self.runner = forward_runner
        elif isinstance(model, TransformersCausalLM):  # the transformers fallback: its own caches
            self.runner = TransformersForwardRunner(model)
        elif model.is_encoder:  # no cache: whole sequences, pooled (encoder_runner.py)
            self.runner = EncoderForwardRunner(model)
        else:
            self.runner = ForwardRunner(
                model,
                num_blocks,
                block_size,
                kv_cache_dtype,
                profile,
                max_num_tokens,
                max_num_seqs,
                max_model_len,
            )
        if isinstance(self.runner, ForwardRunner) and self.runner.profile.fused_cpu_decoder:
            if self.runner.fused is not None:
                logger.info("steps run in the fused CPU decoder (one C++ call a step)")
            else:  # a float model, or an architecture or format it does not take
                logger.info(
                    "steps run layer by layer (not in the fused CPU decoder: %s)",
                    self.runner.fused_unsupported,
                )
        self.structured_outputs = structured_outputs
        self.device = self.runner.device
        self.vocab_size = vocab_size
        self._masks: ThreadPoolExecutor | None = None  # grammar masks, made beside the forward pass
        profile = profile or build_profile(self.device)
        # Beside the forward pass only with a core to spare (DeviceProfile.overlap_masks says why).
        self.overlap_masks = profile.overlap_masks
        self.sampling_policy = profile.sampling
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        # Sampling states of preempted requests, waiting for them to be rescheduled.
        self._parked: dict[str, tuple[RequestSamplingState, int]] = {}

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int, show_progress: bool) -> None:
        """Decode steps of up to `max_num_seqs` requests replay CUDA graphs from now on."""
        assert isinstance(self.runner, ForwardRunner), "the transformers implementation runs eagerly"
        self.runner.use_graphs(max_num_seqs, max_model_len, capture=True).capture(show_progress)

    def warm_up_sampler(self) -> None:
        """Compile the sampler's Triton kernel (seeded draws) now rather than on the first seeded
        request: a compile on the request path stalls every request of that step (~0.5 s)."""
        q = torch.empty(1, self.vocab_size, dtype=torch.float32, device=self.device)
        ints = torch.zeros(1, dtype=torch.int64, device=self.device)
        philox_exponentials_(q, ints, ints, ints)

    def _add(self, new: NewRequestData) -> None:
        sampling, num_prompt_logprobs = self._parked.pop(new.req_id, (None, 0))
        if sampling is None:
            sampling = RequestSamplingState(
                params=new.sampling_params,
                prompt_token_ids=new.prompt_token_ids,
                output_token_ids=list(new.output_token_ids),
                eos_token_ids=new.eos_token_ids,
                generator=make_generator(new.sampling_params.seed, self.device),
            )
            constraint = new.sampling_params.structured_outputs
            if constraint is not None:
                assert self.structured_outputs is not None, "a constrained request needs the manager"
                sampling.grammar = self.structured_outputs.new_state(constraint)
                sampling.grammar.accept_all(new.output_token_ids)
        else:
            sampling.output_token_ids[:] = new.output_token_ids
        self.requests[new.req_id] = CachedRequestState(
            new.req_id,
            new.prompt_token_ids,
            list(new.block_ids),
            new.num_computed_tokens,
            sampling,
            num_prompt_logprobs,
            None
            if new.pooling_params is None
            else PoolingState(new.pooling_params, len(new.prompt_token_ids)),
            new.lora_id,
            RequestImages(new.mm_inputs) if new.mm_inputs else None,
            RopePositions.of(self.runner.model, len(new.prompt_token_ids), new.mm_inputs)
            if new.mm_inputs and getattr(self.runner.model, "rope_axes", 1) > 1
            else None,
        )

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self._parked.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self._parked[req_id] = (state.sampling, state.num_prompt_logprobs)
        if so.finished_req_ids or so.preempted_req_ids:
            self.runner.release([*so.finished_req_ids, *so.preempted_req_ids])
        for new in so.scheduled_new_reqs:
            self._add(new)
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            assert state.num_computed_tokens == cached.num_computed_tokens, cached.req_id

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput([], [])
        batch: list[SequenceBatchEntry] = []
        sample_rows: list[int] = []  # flat-batch row of each sampling request's last token
        samplers: list[tuple[int, CachedRequestState]] = []  # (position in req_ids, state)
        prompt_rows: list[tuple[str, int, int]] = []  # (req_id, first row, first prompt position)
        verifiers: list[Verification] = []  # requests verifying proposed tokens
        pooled: list[tuple[CachedRequestState, int, int, int]] = []  # (state, first row, rows, start)
        row = 0
        for pos, req_id in enumerate(req_ids):
            state, n = self.requests[req_id], so.num_scheduled_tokens[req_id]
            drafts = so.scheduled_spec_tokens.get(req_id)
            if drafts:  # the last real token, then the proposals: every position is scored
                start = state.num_computed_tokens
                assert start + 1 == state.num_tokens and n == 1 + len(drafts), req_id
                batch.append(SequenceBatchEntry([*state.token_slice(start, start + 1), *drafts], start + n,
                                                state.block_ids, req_id, state.lora_id,
                                                rope_positions=state.rope_slice(start, start + n)))  # fmt: skip
                verifiers.append(Verification(pos, state, row, drafts))
                state.num_computed_tokens = start + 1  # and the accepted ones, once verified
                row += n
                continue
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            rows, spans = (
                ((), ())
                if state.images is None or start >= len(state.prompt_token_ids)
                else state.images.chunk_rows(self.runner.model, start, end)
            )
            batch.append(
                SequenceBatchEntry(state.token_slice(start, end), end, state.block_ids, req_id,
                                   state.lora_id, rows, spans, state.rope_slice(start, end))
            )  # fmt: skip
            if state.pooler is not None:  # an embedding request: pooled, never sampled
                if state.pooler.params.second_segment is not None:  # a text pair (an encoder's)
                    batch[-1] = dataclasses.replace(
                        batch[-1], second_segment=state.pooler.params.second_segment
                    )
                pooled.append((state, row, n, start))
                state.num_computed_tokens = end
                row += n
                continue
            # Prompt logprobs for positions [first, end) of this chunk not returned before.
            first = max(start, state.num_prompt_logprobs)
            if state.sampling.params.prompt_logprobs is not None and first < min(
                end, len(state.prompt_token_ids) - 1
            ):
                prompt_rows.append((req_id, row + first - start, first))
            if end == state.num_tokens:
                sample_rows.append(row + n - 1)
                samplers.append((pos, state))
            state.num_computed_tokens = end
            row += n

        # Grammar masks depend only on the tokens sampled so far: where a core is free, they are
        # computed on a worker thread while the forward pass runs (both release the GIL).
        constrained = [i for i, (_, s) in enumerate(samplers) if s.sampling.grammar is not None]
        grammars = [samplers[i][1] for i in constrained]
        masks = (
            self._mask_worker().submit(self._fill_masks, grammars)
            if constrained and self.overlap_masks
            else None
        )
        # the sampled rows and the verified ones through the LM head together (one read of its
        # weights); their indices travel to the device with the step's inputs
        verify_rows = [r for v in verifiers for r in range(v.first_row, v.first_row + len(v.drafts) + 1)]
        try:
            forward = self.runner.forward(batch, sample_rows + verify_rows)
        finally:
            mask = masks.result() if masks is not None else None  # never left running past the step
        if constrained and mask is None:
            mask = self._fill_masks(grammars)
        out = ModelRunnerOutput(req_ids, [[] for _ in req_ids])
        if pooled:
            out.pooled = self._pool(forward.hidden, pooled)
        if prompt_rows:
            out.prompt_logprobs = self._prompt_logprobs(forward.hidden, prompt_rows)
        if samplers or verifiers:
            logits = self.runner.compute_logits(forward.rows())
            if samplers:
                self._sample(logits[: len(sample_rows)], samplers, out, constrained, mask)
            if verifiers:
                self._verify(logits[len(sample_rows) :], verifiers, out)
        return out

    def _pool(
        self, hidden: torch.Tensor, pooled: list[tuple[CachedRequestState, int, int, int]]
    ) -> dict[str, list[float]]:
        """Feed each embedding request's rows to its accumulator; the vectors of those whose
        prompt is now fully computed."""
        done: list[CachedRequestState] = []
        for state, first_row, n, start in pooled:
            assert state.pooler is not None
            state.pooler.add_chunk(hidden[first_row : first_row + n], start)
            if state.num_computed_tokens == len(state.prompt_token_ids):
                done.append(state)
        if not done:
            return {}
        # a cross-encoder scores its pooled rows; an embedding model may project them (Dense layers)
        head = getattr(self.runner.model, "score_head", None) or getattr(
            self.runner.model, "dense_head", None
        )
        vectors = finish([s.pooler for s in done], head)  # type: ignore[misc]
        return {s.req_id: v for s, v in zip(done, vectors, strict=True)}

    def _verify(
        self, all_logits: torch.Tensor, verifiers: list[Verification], out: ModelRunnerOutput
    ) -> None:
        """Score each request's proposed tokens against the model (sample/rejection.py) and
        keep the accepted ones plus the model's next token. `all_logits`: every verifying
        request's k + 1 rows, in order."""
        offset = 0
        for v in verifiers:
            state = v.state
            logits = all_logits[offset : offset + len(v.drafts) + 1]  # [k+1, V]
            offset += len(v.drafts) + 1
            sampling = state.sampling
            drafts = v.drafts
            if sampling.grammar is not None:  # only what the grammar allows is verified, masked
                drafts, masks = self._grammar_masks(sampling.grammar, drafts)
                logits = logits[: len(drafts) + 1]
                self._mask_logits(logits, masks, list(range(len(drafts) + 1)))
            k = len(drafts)
            # Row j is sampled as if the proposals before it were already output (penalties,
            # min_tokens); without either, every row is the request's state as it is.
            params = sampling.params
            if (
                params.repetition_penalty == 1.0 and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0
                and len(sampling.output_token_ids) >= params.min_tokens
            ):  # fmt: skip
                rows = [sampling] * (k + 1)
            else:
                rows = [
                    dataclasses.replace(
                        sampling, output_token_ids=[*sampling.output_token_ids, *v.drafts[:j]]
                    )
                    for j in range(k + 1)
                ]
            # Row j samples output position base + j: a seeded row's draw in the counter mode.
            base = len(sampling.output_token_ids)
            positions = range(base, base + k + 1)
            metadata = SamplingMetadata.build(
                rows, self.vocab_size, self.device, positions, self.sampling_policy
            )
            # Only a generator is rewound to the emitted tokens; counter draws have nothing to rewind.
            generator = sampling.generator if metadata.generators else None
            tokens = verify_proposals(logits, metadata, drafts, generator)
            sampling.output_token_ids.extend(tokens)
            if sampling.grammar is not None:
                sampling.grammar.accept_all(tokens)
            state.num_computed_tokens += len(tokens) - 1
            out.sampled_token_ids[v.pos] = tokens
            n = sampling.params.logprobs
            if n is not None:
                ids = torch.tensor(tokens, device=logits.device)
                out.logprobs[state.req_id] = compute_logprobs(logits[: len(tokens)], ids, n).rows_to_lists(
                    0, len(tokens), n
                )

    def _grammar_masks(self, grammar, drafts: list[int]) -> tuple[list[int], torch.Tensor]:
        """The proposals the grammar accepts in a row, and the allowed-token mask of each of
        their positions and the one after (row j: after the first j proposals); the grammar is
        left where it was."""
        masks = torch.zeros(len(drafts) + 1, bitmask_words(self.vocab_size), dtype=torch.int32)
        matcher = grammar.matcher
        valid = 0
        for j in range(len(drafts) + 1):
            grammar.fill_bitmask(masks[j])
            if j == len(drafts) or matcher.try_consume_tokens([drafts[j]]) != 1:
                break
            valid += 1
        if valid:
            matcher.rollback(valid)
        return drafts[:valid], masks[: valid + 1]

    def _mask_worker(self) -> ThreadPoolExecutor:
        if self._masks is None:
            self._masks = ThreadPoolExecutor(1, thread_name_prefix="llmserve-grammar")
        return self._masks

    def _fill_masks(self, states: list[CachedRequestState]) -> torch.Tensor:
        """Row j: the tokens the grammar of states[j] allows next."""
        mask = torch.zeros(len(states), bitmask_words(self.vocab_size), dtype=torch.int32)
        for j, state in enumerate(states):
            assert state.sampling.grammar is not None
            state.sampling.grammar.fill_bitmask(mask[j])
        return mask

    def _sample(
        self,
        logits: torch.Tensor,
        states: list[tuple[int, CachedRequestState]],
        out: ModelRunnerOutput,
        constrained: list[int],
        mask: torch.Tensor | None,
    ) -> None:
        """`logits` [num_sampling, vocab]: the last position of each sampling request."""
        if mask is not None:
            self._mask_logits(logits, mask, constrained)
        metadata = SamplingMetadata.build(
            [s.sampling for _, s in states], self.vocab_size, self.device, policy=self.sampling_policy
        )
        # the step's one device->host sync: the sampled ids and their logprobs in one copy
        tokens, logprobs = self.sampler(logits, metadata).to_host()
        for i, ((pos, state), token) in enumerate(zip(states, tokens, strict=True)):
            state.output_token_ids.append(token)
            if state.sampling.grammar is not None:
                state.sampling.grammar.accept(token)
            out.sampled_token_ids[pos] = [token]
            k = state.sampling.params.logprobs
            if k is not None and logprobs is not None:
                out.logprobs[state.req_id] = logprobs.to_lists(i, k)

    @staticmethod
    def _mask_logits(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
        """-inf for every token the grammar of each constrained row forbids next (logit columns
        past the tokenizer's vocabulary, where a model pads its head, are forbidden too)."""
        extra = bitmask_words(logits.shape[1]) - mask.shape[1]
        if extra > 0:
            mask = torch.nn.functional.pad(mask, (0, extra))
        if len(rows) == logits.shape[0]:  # every row constrained: in place
            apply_bitmask(logits, mask)
            return
        index = to_device_async(torch.tensor(rows), logits.device)
        masked = logits.index_select(0, index)
        apply_bitmask(masked, mask)
        logits.index_copy_(0, index, masked)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, rows: list[tuple[str, int, int]]
    ) -> dict[str, Logprobs | None]:
        """Logprobs of the prompt tokens this chunk predicts: position p scores prompt token p + 1."""
        result: dict[str, Logprobs | None] = {}
        for req_id, first_row, start in rows:
            state = self.requests[req_id]
            P = len(state.prompt_token_ids)
            # Positions up to the chunk's end that still have a next prompt token to score.
            end = min(state.num_computed_tokens, P - 1)
            state.num_prompt_logprobs = end
            logits = self.runner.compute_logits(hidden[first_row : first_row + end - start])
            targets = torch.tensor(state.prompt_token_ids[start + 1 : end + 1], device=logits.device)
            k = state.sampling.params.prompt_logprobs or 0
            result[req_id] = compute_logprobs(logits.float(), targets, k).rows_to_lists(0, len(targets), k)
        return result


@dataclass(slots=True)
class Verification:
    """A request verifying proposed tokens this step."""

    pos: int
    """Its place in the step's requests."""
    state: CachedRequestState
    first_row: int
    """The flat-batch row of its last real token; the proposals' rows follow."""
    drafts: list[int]
