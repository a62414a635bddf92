"""`InputBuffers`: a step's input tensors, kept in buffers that live as long as the runner.

Every step writes its flat batch into the same memory, so the tensors the model and the
attention kernels read have fixed addresses (what a CUDA graph replays against) and nothing is
allocated per step:

    host (numpy views; pinned on CUDA)          device (one copy per tensor per step)
    input_ids     [max_tokens]   int64    -->   input_ids     [:T]
    positions     [max_tokens]   int64    -->   positions     [:T]
    slot_mapping  [max_tokens]   int64    -->   slot_mapping  [:T]
    seq_lens      [max_seqs]     int32    -->   seq_lens      [:S]
    query_start   [max_seqs + 1] int32    -->   query_start   [:S + 1]
    logits_rows   [max_tokens]   int64    -->   logits_rows   [:R]   the rows the LM head reads
    rope_positions [3 * max_tokens] int64 -->   viewed as [3, T]: M-RoPE's three ids a token
                                                (only for a model with `rope_axes` 3)
    block_tables  [max_seqs * max_blocks] -->   viewed as [S, W], contiguous: row i holds sequence
                                                i's blocks, padded with the pad block past its last

On the CPU host and device are the same tensors (no copy). `W` is the widest block table of the
batch, or a fixed width when asked (a CUDA graph needs the same shape at every replay). Buffers
grow when a batch is larger than any before (a graph captured on the old ones is then void:
`generation` counts the growths).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from llmserve.layers.attention import AttentionMetadata


@dataclass(frozen=True, slots=True)
class SequenceBatchEntry:
    """One sequence's part of a forward pass."""

    new_token_ids: Sequence[int]
    """Tokens to run now: the last `len(new_token_ids)` tokens of the context."""
    seq_len: int
    """Context length after this step (tokens already cached + new ones)."""
    block_ids: Sequence[int]
    """Cache blocks holding this sequence, in order; enough for `seq_len` tokens."""
    req_id: str = ""
    """The request it belongs to (runners that keep per-request state use it)."""
    lora_id: int = 0
    """The LoRA adapter its tokens run with (0: the base model)."""
    image_rows: tuple[tuple[int, torch.Tensor], ...] = ()
    """Images' vectors for some of its new tokens: (index of the first such token among
    `new_token_ids`, vectors [n, hidden]); they replace those tokens' embeddings."""
    bidirectional: tuple[tuple[int, int], ...] = ()
    """Position spans [start, end) whose tokens attend to each other both ways (its images')."""
    rope_positions: np.ndarray | None = None
    """[3, len(new_token_ids)] M-RoPE positions of its new tokens (None: its sequence positions
    on all three axes, what a request without images has)."""
    second_segment: int | None = None
    """An encoder's text pair: the position where its second text starts (token type 1 from
    there on, `PoolingParams.second_segment`); None: one segment."""


@dataclass(frozen=True, slots=True)
class ForwardOutput:
    """One forward pass's result: the hidden states of every new token, the step's attention
    metadata, and the rows the caller asked to project to the vocabulary, on the device."""

    hidden: torch.Tensor  # [num_new_tokens, hidden]
    metadata: AttentionMetadata | None
    logits_rows: torch.Tensor | None = None  # [R] int64

    def rows(self) -> torch.Tensor:
        """hidden[logits_rows] (no copy of the indices, which travelled with the step's inputs)."""
        assert self.logits_rows is not None, "forward() was given no logits_rows"
        return self.hidden.index_select(0, self.logits_rows)


@dataclass(frozen=True, slots=True)
class StepInputs:
    """What one forward pass reads: views of the buffers."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    logits_rows: torch.Tensor | None = None
    """[R] int64 on the device: the flat-batch rows whose hidden states go through the LM head
    (sent with the other inputs, so selecting them after the forward needs no copy or sync)."""
    rope_positions: torch.Tensor | None = None
    """[3, T] for a model with M-RoPE (what it takes as positions); `positions` still place K/V."""

    @property
    def model_positions(self) -> torch.Tensor:
        """The positions the model's forward takes: [T], or [3, T] under M-RoPE."""
        return self.positions if self.rope_positions is None else self.rope_positions


class InputBuffers:
    def __init__(
        self,
        device: torch.device,
        block_size: int,
        pad_block: int,
        max_num_tokens: int = 256,
        max_num_seqs: int = 16,
        max_num_blocks: int = 16,
        pin_memory: bool = False,
        rope_axes: int = 1,
    ) -> None:
        """`pad_block`: a cache block no sequence owns, where padding rows write their K/V.
        `rope_axes`: the model's position ids a token (3: M-RoPE's buffer too)."""
        self.device, self.block_size, self.pad_block = device, block_size, pad_block
        self.rope_axes = rope_axes
        self.pin_memory = pin_memory and device.type != "cpu"
        self.generation = 0
        self._allocate(max_num_tokens, max_num_seqs, max_num_blocks)

    def _allocate(self, num_tokens: int, num_seqs: int, num_blocks: int) -> None:
        self.max_num_tokens, self.max_num_seqs, self.max_num_blocks = num_tokens, num_seqs, num_blocks
        sizes = {
            "input_ids": (num_tokens, torch.int64),
            "positions": (num_tokens, torch.int64),
            "slot_mapping": (num_tokens, torch.int64),
            "seq_lens": (num_seqs, torch.int32),
            "query_start_loc": (num_seqs + 1, torch.int32),
            "block_tables": (num_seqs * num_blocks, torch.int64),
            "logits_rows": (num_tokens, torch.int64),
        }
        if self.rope_axes > 1:
            sizes["rope_positions"] = (self.rope_axes * num_tokens, torch.int64)
        self.host = {k: torch.zeros(n, dtype=t, pin_memory=self.pin_memory) for k, (n, t) in sizes.items()}
        self.np = {k: v.numpy() for k, v in self.host.items()}
        on_host = self.device.type == "cpu"
        self.dev = {
            k: v if on_host else torch.zeros_like(v, device=self.device) for k, v in self.host.items()
        }
        self.generation += 1

    def ensure(self, num_tokens: int, num_seqs: int, num_blocks: int) -> None:
        """Room for a batch of this size (grown to at least twice the old size, so a slowly
        growing load reallocates only a few times)."""
        have = (self.max_num_tokens, self.max_num_seqs, self.max_num_blocks)
        need = (num_tokens, num_seqs, num_blocks)
        if any(n > h for n, h in zip(need, have, strict=True)):
            self._allocate(*(h if n <= h else max(n, 2 * h) for n, h in zip(need, have, strict=True)))

    def fill(
        self,
        batch: Sequence[SequenceBatchEntry],
        width: int | None = None,
        logits_rows: Sequence[int] | None = None,
    ) -> StepInputs:
        """Write `batch` into the buffers and return the step's views. `width`: the block tables'
        width (default: the batch's widest). `logits_rows`: rows of the flat batch the caller will
        project to the vocabulary (uploaded with the rest)."""
        S = len(batch)
        T = sum(len(e.new_token_ids) for e in batch)
        W = width or max(len(e.block_ids) for e in batch)
        self.ensure(T, S, W)
        B, np_ = self.block_size, self.np
        ids, pos, slots = np_["input_ids"], np_["positions"], np_["slot_mapping"]
        tables = np_["block_tables"][: S * W].reshape(S, W)
        tables.fill(self.pad_block)
        query_lens, seq_lens, starts = [0] * S, [0] * S, [0] * (S + 1)
        t = 0
        for i, e in enumerate(batch):
            q, s = len(e.new_token_ids), e.seq_len
            assert 0 < q <= s <= len(e.block_ids) * B, (q, s, len(e.block_ids))
            tables[i, : len(e.block_ids)] = e.block_ids
            if q == 1:  # a decode, most rows of a step: plain ints, no arrays
                ids[t], pos[t] = e.new_token_ids[0], s - 1
                slots[t] = e.block_ids[(s - 1) // B] * B + (s - 1) % B
            else:
                ids[t : t + q] = e.new_token_ids
                p = np.arange(s - q, s, dtype=np.int64)
                pos[t : t + q] = p
                slots[t : t + q] = np.asarray(e.block_ids, dtype=np.int64)[p // B] * B + p % B
            query_lens[i], seq_lens[i] = q, s
            t += q
            starts[i + 1] = t
        if self.rope_axes > 1:
            self._fill_rope_positions(batch, T)
        np_["seq_lens"][:S] = seq_lens
        np_["query_start_loc"][: S + 1] = starts
        R = 0 if logits_rows is None else len(logits_rows)
        if R:
            np_["logits_rows"][:R] = logits_rows
        dev = self._upload(T, S, W, R)
        md = AttentionMetadata(
            query_lens=query_lens,
            seq_lens=seq_lens,
            query_start_loc=starts,
            slot_mapping=dev["slot_mapping"],
            block_tables=dev["block_tables"],
            block_size=B,
            seq_lens_tensor=dev["seq_lens"],
            query_start_loc_tensor=dev["query_start_loc"],
            max_query_len=max(query_lens),
            bidirectional={i: list(e.bidirectional) for i, e in enumerate(batch) if e.bidirectional},
        )
        return StepInputs(
            dev["input_ids"],
            dev["positions"],
            md,
            dev["logits_rows"] if R else None,
            dev.get("rope_positions"),
        )

    def _fill_rope_positions(self, batch: Sequence[SequenceBatchEntry], T: int) -> None:
        """M-RoPE's [3, T] ids: the sequence positions on every axis, or an entry's own."""
        rope = self.np["rope_positions"][: self.rope_axes * T].reshape(self.rope_axes, T)
        rope[:] = self.np["positions"][:T]
        t = 0
        for e in batch:
            q = len(e.new_token_ids)
            if e.rope_positions is not None:
                rope[:, t : t + q] = e.rope_positions
            t += q

    def _upload(self, T: int, S: int, W: int, R: int) -> dict[str, torch.Tensor]:
        """The step's device views; on CUDA, one asynchronous copy per tensor from pinned memory
        (the host buffers are rewritten only after the step's sampled ids were read back, which
        waits for these copies)."""
        lengths = {"input_ids": T, "positions": T, "slot_mapping": T, "seq_lens": S, "query_start_loc": S + 1}
        lengths["block_tables"] = S * W
        lengths["logits_rows"] = R
        if self.rope_axes > 1:
            lengths["rope_positions"] = self.rope_axes * T
        views = {}
        for name, n in lengths.items():
            dst = self.dev[name][:n]
            if n and dst.data_ptr() != self.host[name].data_ptr():
                dst.copy_(self.host[name][:n], non_blocking=self.pin_memory)
            views[name] = dst
        views["block_tables"] = views["block_tables"].view(S, W)
        if self.rope_axes > 1:
            views["rope_positions"] = views["rope_positions"].view(self.rope_axes, T)
        return views
