"""Top-k, top-p and min-p: which tokens of a row may be sampled. Only a row whose top-p has no
top-k sorts its vocabulary; every other row gets the same set from its largest few logits.

The semantics are the sort-based reference's, `filter_by_sorting` (the code before this module):

    sort x ascending, stably             ties sit in vocab-id order, so the higher id ranks above
    top-k  exactly k survive             the last k sorted positions
    top-p  p = softmax(sorted x); drop the positions whose ascending cumulative mass <= 1 - top_p:
           the smallest most-likely set whose mass reaches top_p (the most likely always survives)
    min-p  drop p < min_p * p_max        (a ratio: unaffected by top-k's renormalization)

`apply_filters` keeps that set without the sort; B rows, V tokens, W the largest k of a top-k
row or of a top-p row under a top-k; R the rows whose top-p has no top-k (the set reaching top_p
may be any size, so they need every token in order):

    1. vals = topk(x, W).values               [B, W] descending, the exact values
    2. top-p: the reference's filtered sorted row is [-inf x (V - k), the k largest ascending]:
              rebuilt from vals, then its softmax and cumsum are the reference's own floats
              (same input, same kernels), and the dropped positions are a prefix of it:
              k' = V - #dropped tokens survive
    3. keep the k largest (k' on top-p rows) under (value, id): thr = vals[k - 1]; x > thr, then
              of the ties x == thr the highest ids, counted by a cumsum     [B, V] elementwise
    4. min-p: the vocabulary-order softmax's p / p_max. Its 1/sum differs from the sorted row's
              in rounding, which moves p_j against min_p * p_max only where exp(x_j - max) is
              within a few ulps of min_p. With `host_checks` (the CPU, where looking at a value
              costs nothing) a batch with a token that close re-runs the reference, so the
              CPU's choices are the reference's bit for bit; without (CUDA, where it would cost
              a sync) it stands, a difference of rounding like any other between devices.
    5. the R rows: the reference itself (a stable sort), on those rows alone

No step branches on a tensor's value (except 4 with host_checks), so nothing here syncs a GPU.
Cost: benchmarks/bench_sampler.py (the reference sorts every row of a batch with any filter on:
~100 ms for 16 rows of V = 151936 on this project's 2-core CPU; top-k 50 here takes a few ms).
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")
_MIN_P_MARGIN = 2.0**-20
"""Relative distance from the min-p threshold within which a rounding of 1/sum could decide
(the products e * inv and min_p * inv round at 2^-24; e and min_p must be that close)."""
_MIN_P_FLOOR = 2.0**-130
"""Absolute part of that margin, for thresholds in the subnormal range."""


def apply_filters(
    x: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    width: int,
    sort_rows: torch.Tensor | None,
    host_checks: bool,
) -> torch.Tensor:
    """Set filtered-out tokens of `x` [B, V] to -inf, in place; a None filter is off for all rows.

    `top_k` [B] int64 in [1, V] (V = off), `top_p` [B] in (0, 1] (1 = off), `min_p` [B] in
    [0, 1] (0 = off). `width`: the largest k of a row whose top-k is on, or whose top_p < 1 under
    a top-k (0: none); `sort_rows` [R]: the rows with top_p < 1 and no top-k (None: none).
    `host_checks`: may look at values on the host (the module docstring, step 4)."""
    batch, vocab_size = x.shape
    keep = None
    if width > 0:
        k = top_k if top_k is not None else torch.full((batch,), vocab_size, device=x.device)
        vals = x.topk(width, dim=-1).values  # [B, W] descending
        k_kept = k if top_p is None else _top_p_counts(vals, k, top_p, vocab_size)
        keep = _largest_k(x, vals, k_kept)
        if sort_rows is not None:
            keep.index_fill_(0, sort_rows, True)  # their top-p is below
    if min_p is not None:  # before x changes: the reference may need it as it came
        keep_min_p = _min_p_mask(x, min_p, keep, host_checks)
        if keep_min_p is None:  # a token within rounding of min-p's threshold: the reference decides
            return filter_by_sorting(x, top_k, top_p, min_p)
        keep = keep_min_p if keep is None else keep & keep_min_p
    if sort_rows is not None:  # top-p without top-k: the reference itself, on these rows alone
        assert top_p is not None
        if len(sort_rows) == batch:
            filter_by_sorting(x, None, top_p, None)
        else:
            rows = x.index_select(0, sort_rows)  # [R, V]
            x.index_copy_(0, sort_rows, filter_by_sorting(rows, None, top_p.index_select(0, sort_rows), None))
    if keep is not None:
        x.masked_fill_(~keep, _NEG_INF)
    return x


def _top_p_counts(vals: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B] how many tokens survive top-k then top-p: the reference's floats, without its sort.

    The rebuilt row equals the reference's `sorted_x` after its top-k mask:

        position   0 ............ V-W ........ V-k ........ V-1
        value      -inf ......... -inf ... -inf | k largest, ascending |
    """
    batch, width = vals.shape
    kept = k.clamp(max=width)  # top-p rows have k <= W; others are not read
    ascending = vals.flip(-1)  # [B, W]
    column = torch.arange(width, device=vals.device)
    ascending = ascending.masked_fill(column < (width - kept).unsqueeze(1), _NEG_INF)
    sorted_x = vals.new_full((batch, vocab_size), _NEG_INF)  # [B, V]
    sorted_x[:, vocab_size - width :] = ascending
    tail_mass = sorted_x.softmax(dim=-1).cumsum(dim=-1)  # [B, V], as the reference computes it
    drop = tail_mass <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False  # float error must never empty a row
    # The mass is non-decreasing along the row, so the dropped positions are a prefix (on the
    # CPU cumsum accumulates in double; a GPU's parallel scan could break that by a rounding,
    # which would move the boundary by a token against a sort on that GPU).
    survivors = vocab_size - drop.sum(dim=-1)  # [B]
    return torch.where(top_p < 1.0, survivors, k)


def _largest_k(x: torch.Tensor, vals: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[B, V] bool: the k[b] largest of each row, ties broken toward the higher vocab id (the
    stable ascending sort's last k). `vals` [B, W] holds each row's W largest, descending, with
    W >= k wherever k < V; a row with k = V keeps everything."""
    vocab_size = x.shape[-1]
    threshold = vals.gather(1, (k.clamp(max=vals.shape[1]) - 1).unsqueeze(1))  # [B, 1]: the k-th largest
    above = x > threshold  # [B, V]
    tied = x == threshold  # [B, V]
    num_tied_kept = k.unsqueeze(1) - above.sum(dim=-1, keepdim=True)  # [B, 1], >= 1
    tied_so_far = tied.cumsum(dim=-1, dtype=torch.int32)  # [B, V]: ties at ids <= this one
    # A tie survives when fewer than `num_tied_kept` ties have a higher id.
    highest_ties = tied & (tied_so_far > tied_so_far[:, -1:] - num_tied_kept)
    return above | highest_ties | (k >= vocab_size).unsqueeze(1)


def _min_p_mask(
    x: torch.Tensor, min_p: torch.Tensor, keep: torch.Tensor | None, host_checks: bool
) -> torch.Tensor | None:
    """[B, V] bool: p >= min_p * p_max, or None when `host_checks` finds a surviving token close
    enough to the threshold that the reference's rounding could decide it."""
    probs = x.softmax(dim=-1)  # [B, V] in vocabulary order
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    if host_checks:
        near = (probs - threshold).abs() <= threshold * _MIN_P_MARGIN + _MIN_P_FLOOR
        near &= (min_p > 0.0).unsqueeze(1)
        near &= x < x.amax(dim=-1, keepdim=True)  # exp(0) = 1 >= min_p: the row's maxima always stay
        if keep is not None:
            near &= keep
        if bool(near.any()):
            return None
    return probs >= threshold


def filter_by_sorting(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """The reference: one stable sort of every row, then the filters in sorted order; in place.
    Used where `apply_filters` defers to it, and by the tests as the oracle."""
    vocab_size = logits.shape[-1]
    sorted_x, order = logits.sort(dim=-1, stable=True)  # [B, V] ascending: the most likely token is last
    if top_k is not None:
        position = torch.arange(vocab_size, device=logits.device)  # [V]
        sorted_x.masked_fill_(position < (vocab_size - top_k).unsqueeze(1), _NEG_INF)
    if top_p is not None or min_p is not None:
        probs = sorted_x.softmax(dim=-1)  # [B, V], after top-k
        drop = torch.zeros_like(sorted_x, dtype=torch.bool)
        if top_p is not None:
            tail_mass = probs.cumsum(dim=-1)  # [B, V] mass of this token and every less likely one
            # top_p = 1 is off: without the guard, tokens of zero probability would be dropped.
            drop |= (tail_mass <= (1.0 - top_p).unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
            drop[:, -1] = False  # float error must never empty a row
        if min_p is not None:
            drop |= probs < min_p.unsqueeze(1) * probs[:, -1:]
        sorted_x.masked_fill_(drop, _NEG_INF)
    return logits.scatter_(-1, order, sorted_x)
