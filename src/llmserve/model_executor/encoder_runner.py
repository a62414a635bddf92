"""`EncoderForwardRunner`: one forward pass of an encoder-only model (BERT) over whole sequences.

How an encoder goes through the engine (vLLM runs encoders as pooling models in the same
scheduler; this is that route, without a cache):

  - the same `Scheduler`, `ModelRunner` and pooling path as a decoder's embedding requests, so
    encoder requests are batched in flight with each other, queued, aborted and counted the same;
  - the scheduler never splits an encoder's prompt into chunks (`chunked_prefill=False`): a token
    attends to the tokens after it too, so a sequence runs whole in one step, and the engine
    checks at start-up that `max_num_batched_tokens` holds the longest one;
  - no KV cache: nothing of a sequence outlives its forward pass. The scheduler's blocks are
    bookkeeping only (the engine gives it enough for `max_num_seqs` full sequences), prefix
    caching is off, and this runner allocates no cache memory;
  - the model's final hidden states go to the pooler (mean / cls / last, from the model's
    sentence-transformers files); nothing is sampled, and generation requests are refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmserve.layers.attention.encoder import EncoderMetadata
from llmserve.model_executor.input_buffers import ForwardOutput, SequenceBatchEntry
from llmserve.models import CausalLM


class EncoderForwardRunner:
    def __init__(self, model: CausalLM) -> None:
        assert model.is_encoder, f"{type(model).__name__} is not an encoder"
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype

    def release(self, req_ids: list[str]) -> None:
        """Nothing to free: no state outlives a forward pass."""

    def forward(
        self, batch: list[SequenceBatchEntry], logits_rows: Sequence[int] | None = None
    ) -> ForwardOutput:
        """Hidden states [T, hidden] of every sequence of the batch, each run whole."""
        assert not logits_rows, "an encoder has no LM head: nothing is sampled"
        for e in batch:
            assert len(e.new_token_ids) == e.seq_len, f"{e.req_id}: an encoder runs a sequence whole"
        seq_lens = [e.seq_len for e in batch]
        ids = torch.tensor([t for e in batch for t in e.new_token_ids], dtype=torch.int64)
        positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in seq_lens])
        md = EncoderMetadata.build(seq_lens, self.device, [e.second_segment for e in batch])
        hidden = self.model(ids.to(self.device), positions.to(self.device), md)
        return ForwardOutput(hidden, None)
