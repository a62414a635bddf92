"""The draft-model proposer: a small model that shares the target's vocabulary proposes its own
greedy continuation, run by the same machinery as the target (a `ForwardRunner` with its own
paged KV cache, block tables kept by a `KVCacheManager`).

Per step, for the requests that decode:

    round 0     each request's tokens the draft has not seen (its prompt the first time, then the
                tokens the last verification kept) in one batched forward -> argmax = proposal 1
    rounds 1..  the previous proposal of every request, one token each -> proposals 2..k

The draft's K/V stay valid up to the tokens the target kept: at the next step, the proposals the
target accepted (compared with what it emitted) are counted as computed, the rest are overwritten.
Proposals are greedy: a single token each, which is what verification expects
(sample/rejection.py). A request whose draft blocks cannot be allocated simply gets no proposal (its
draft state is dropped and rebuilt later).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from llmserve.config import ModelConfig
from llmserve.core.kv_cache.manager import KVCacheManager
from llmserve.core.request import Request
from llmserve.layers.attention import KVDtypes
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.model_loader import LoadedModel, load_model
from llmserve.sampling_params import SamplingParams

logger = logging.getLogger("llmserve")


@dataclass(slots=True)
class _DraftState:
    shadow: Request
    """The draft's view of the request: its num_computed_tokens are the draft's."""
    base: int = 0
    """The request's length when the last proposal was made."""
    proposed: list[int] = field(default_factory=list)
    """The proposals fed through the draft at the last step (all but the last one)."""


class DraftModelProposer:
    @staticmethod
    def load(model: str, target: LoadedModel, quantization: str) -> LoadedModel:
        """The draft `model`, loaded on the target's device (before the KV cache is sized: its
        cache takes a share of the same budget)."""
        loaded = load_model(
            ModelConfig(
                model=model, device=str(target.device), quantization=quantization, show_progress=False
            )  # type: ignore[arg-type]
        )
        vocab, target_vocab = int(loaded.text_config.vocab_size), int(target.text_config.vocab_size)
        if vocab > target_vocab:
            raise ValueError(
                f"the draft model {model!r} has a vocabulary of {vocab} tokens, larger than the target's "
                f"{target_vocab}: they must share one"
            )
        return loaded

    def __init__(
        self,
        model: str,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: torch.dtype | KVDtypes | None = None,
    ) -> None:
        """The draft `model` (`loaded` by `load`); its KV cache holds `num_blocks` blocks, as the
        target's does."""
        self.loaded = loaded
        self.vocab_size = int(loaded.text_config.vocab_size)
        self.runner = ForwardRunner(
            self.loaded.model, num_blocks, block_size, kv_cache_dtype, self.loaded.profile,
            max_model_len=self.loaded.max_model_len,
        )  # fmt: skip
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
        self._states: dict[str, _DraftState] = {}
        logger.info("speculative decoding: draft model %s (%s)", model, self.loaded.checkpoint_format)

    def retain(self, live: Mapping[str, object]) -> None:
        """Free the draft blocks of requests no longer in `live`."""
        for rid in [rid for rid in self._states if rid not in live]:
            self.kv.free(self._states.pop(rid).shadow)

    def _state(self, request: Request) -> _DraftState:
        state = self._states.get(request.request_id)
        if state is None:
            shadow = Request(request.request_id, [], SamplingParams(max_tokens=1))
            state = self._states[request.request_id] = _DraftState(shadow)
            return state
        # proposals the target kept are tokens the draft already computed
        kept = 0
        while (
            kept < len(state.proposed)
            and state.base + kept < request.num_tokens
            and request.token_id(state.base + kept) == state.proposed[kept]
        ):
            kept += 1
        # (the last token is always fed again: its logits give the next proposal)
        state.shadow.num_computed_tokens = min(
            state.shadow.num_computed_tokens, state.base + kept, request.num_tokens - 1
        )
        state.proposed = []
        return state

    @torch.inference_mode()
    def propose_batch(self, requests: list[Request], k: int) -> dict[str, list[int]]:
        """Up to `k` proposed tokens for each of `requests` (decoding ones)."""
        batch: list[SequenceBatchEntry] = []
        members: list[tuple[Request, _DraftState]] = []
        for request in requests:
            state = self._state(request)
            length = request.num_tokens
            start = state.shadow.num_computed_tokens
            # room for the unseen tokens and the k - 1 proposals fed back (the last is never fed)
            if self.kv.allocate_slots(state.shadow, length - start + k - 1) is None:
                self.kv.free(self._states.pop(request.request_id).shadow)
                continue
            ids = [request.token_id(i) for i in range(start, length)]
            batch.append(
                SequenceBatchEntry(ids, length, self.kv.get_block_ids(request.request_id), request.request_id)
            )
            members.append((request, state))
        if not members:
            return {}
        proposals: list[list[int]] = [[] for _ in members]
        for j in range(k):
            last = list(itertools.accumulate(len(e.new_token_ids) for e in batch))
            forward = self.runner.forward(batch, [r - 1 for r in last])
            logits = self.runner.model.compute_logits(forward.rows())[:, : self.vocab_size]
            tokens = logits.argmax(dim=-1).tolist()
            for i, token in enumerate(tokens):
                proposals[i].append(token)
            if j == k - 1:
                break
            batch = [
                SequenceBatchEntry([tokens[i]], e.seq_len + 1, e.block_ids, e.req_id)
                for i, e in enumerate(batch)
            ]
        out = {}
        for (request, state), proposal in zip(members, proposals, strict=True):
            state.base = request.num_tokens
            state.proposed = proposal[:-1]
            state.shadow.num_computed_tokens = request.num_tokens + k - 1
            out[request.request_id] = proposal
        return out
