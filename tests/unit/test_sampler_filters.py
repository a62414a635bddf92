"""Top-k / top-p / min-p without the full sort (sample/filters.py) against the sort-based reference:
the same surviving tokens bit for bit on the CPU, on random logits full of ties and edge values,
and no sort of the vocabulary where a cheaper way exists."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve.sample.filters import apply_filters, filter_by_sorting

NEG_INF = float("-inf")


def plan(
    top_k: list[int] | None, top_p: list[float] | None, vocab_size: int
) -> tuple[int, torch.Tensor | None]:
    """SamplingMetadata's `filter_width` and `sort_rows` for these filters."""
    rows = len(top_k or top_p or [])
    ks = top_k or [vocab_size] * rows
    ps = top_p or [1.0] * rows
    width = max([k for k, p in zip(ks, ps, strict=True) if k < vocab_size], default=0)
    sort_rows = [i for i, (k, p) in enumerate(zip(ks, ps, strict=True)) if p < 1.0 and k == vocab_size]
    return width, torch.tensor(sort_rows) if sort_rows else None


def filters(
    top_k: list[int] | None, top_p: list[float] | None, min_p: list[float] | None, vocab_size: int
) -> tuple:
    """(top_k, top_p, min_p, width, sort_rows): `apply_filters`' arguments but host_checks."""
    as_tensor = lambda v, dtype: None if v is None else torch.tensor(v, dtype=dtype)  # noqa: E731
    width, sort_rows = plan(top_k, top_p, vocab_size)
    return (
        as_tensor(top_k, torch.int64),
        as_tensor(top_p, torch.float32),
        as_tensor(min_p, torch.float32),
        width,
        sort_rows,
    )


def assert_same_as_reference(x: torch.Tensor, top_k, top_p, min_p, host_checks: bool = True) -> None:
    k, p, m, width, sort_rows = filters(top_k, top_p, min_p, x.shape[1])
    expected = filter_by_sorting(x.clone(), k, p, m)
    got = apply_filters(x.clone(), k, p, m, width, sort_rows, host_checks)
    assert torch.equal(got.isneginf(), expected.isneginf())
    assert torch.equal(got, expected)


def random_logits(rng: random.Random, rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    """Logits of every awkward kind: bf16-rounded (ties near the top), integers (many ties), all
    equal, -inf entries, underflowing ones, flat and peaked scales."""
    x = torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(seed))
    x *= rng.choice([0.01, 1.0, 5.0, 50.0])
    kind = rng.random()
    if kind < 0.3:
        x = x.to(torch.bfloat16).float()
    elif kind < 0.45:
        x = x.round()
    elif kind < 0.5:
        x = torch.zeros(rows, vocab_size)
    if rng.random() < 0.2:
        x[:, rng.randrange(vocab_size)] = NEG_INF
    if rng.random() < 0.1:
        x[:, : vocab_size // 2] = -200.0  # probability exactly 0 after softmax
    return x


@pytest.mark.parametrize("seed", range(4))
def test_random_cases_equal_the_sorting_reference(seed: int) -> None:
    rng = random.Random(seed)
    for case in range(150):
        vocab_size = rng.choice([1, 2, 7, 64, 300, 2048])
        rows = rng.choice([1, 3, 8])
        x = random_logits(rng, rows, vocab_size, seed * 1000 + case)
        top_k = [
            min(rng.choice([1, 2, 3, 10, vocab_size, vocab_size - 1]) or 1, vocab_size) for _ in range(rows)
        ]
        top_p = [rng.choice([1.0, 0.05, 0.5, 0.9, 0.999]) for _ in range(rows)]
        min_p = [rng.choice([0.0, 0.01, 0.3, 1.0]) for _ in range(rows)]
        assert_same_as_reference(
            x,
            top_k if rng.random() < 0.6 else None,
            top_p if rng.random() < 0.6 else None,
            min_p if rng.random() < 0.5 else None,
        )


EDGES = [
    # top_k, top_p, min_p (per row: 4 rows)
    ([1, 1, 1, 1], None, None),
    ([64, 64, 64, 64], None, None),  # k = V
    ([5, 64, 1, 63], None, None),
    (None, [1.0, 1.0, 1.0, 1.0], None),
    (None, None, [0.0, 0.0, 0.0, 0.0]),
    ([3, 64, 10, 2], [1.0, 0.5, 0.9, 1.0], [0.0, 0.0, 0.2, 1.0]),
    (None, [0.3, 1.0, 0.99, 0.5], [1.0, 0.05, 0.0, 0.5]),
]


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), EDGES)
@pytest.mark.parametrize("logits", ["all_equal", "two_levels", "bf16_ties", "with_neg_inf"])
def test_edge_values(top_k, top_p, min_p, logits: str) -> None:
    vocab_size = 64
    g = torch.Generator().manual_seed(7)
    x = {
        "all_equal": torch.full((4, vocab_size), 0.5),
        "two_levels": (torch.rand(4, vocab_size, generator=g) > 0.7).float() * 2.0,
        "bf16_ties": (torch.randn(4, vocab_size, generator=g) * 0.1).to(torch.bfloat16).float(),
        "with_neg_inf": torch.randn(4, vocab_size, generator=g).masked_fill(
            torch.rand(4, vocab_size, generator=g) < 0.9, NEG_INF
        ),
    }[logits]
    assert_same_as_reference(x, top_k, top_p, min_p)


def test_top_k_ties_keep_the_higher_ids() -> None:
    x = torch.tensor([[1.0, 3.0, 2.0, 2.0, 2.0, 0.0]])
    out = apply_filters(x.clone(), torch.tensor([3]), None, None, 3, None, True)
    # 3.0 (id 1), then two of the three 2.0s: the higher ids 3 and 4
    assert out.isfinite().nonzero()[:, 1].tolist() == [1, 3, 4]


def test_only_a_top_p_row_without_top_k_sorts(monkeypatch: pytest.MonkeyPatch) -> None:
    """top-k alone, and top-p / min-p under a top-k, never sort: only topk of the widest k. A
    top-p row without top-k needs its whole order: that row alone is sorted."""
    topk_widths: list[int] = []
    sorted_rows: list[int] = []
    real_topk, real_sort = torch.Tensor.topk, torch.Tensor.sort

    def topk(self: torch.Tensor, k: int, *args, **kwargs):
        topk_widths.append(k)
        return real_topk(self, k, *args, **kwargs)

    def sort(self: torch.Tensor, *args, **kwargs):
        sorted_rows.append(self.shape[0])
        return real_sort(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "topk", topk)
    monkeypatch.setattr(torch.Tensor, "sort", sort)
    x = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    cases = [
        ([50, 1000, 5, 20], None, None),
        ([50, 1000, 5, 20], [0.9, 1.0, 0.5, 0.8], [0.0, 0.1, 0.0, 0.2]),
        (None, None, [0.05, 0.0, 0.1, 0.3]),  # min-p alone: no topk at all
    ]
    for top_k, top_p, min_p in cases:
        apply_filters(x.clone(), *filters(top_k, top_p, min_p, 1000), True)
    assert topk_widths == [50, 50] and sorted_rows == []
    apply_filters(x.clone(), *filters([50, 1000, 5, 1000], [0.9, 0.9, 1.0, 1.0], None, 1000), True)
    assert topk_widths[-1] == 50 and sorted_rows == [1]  # row 1 only


def test_min_p_within_rounding_of_the_threshold_defers_to_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """exp(x - max) equal to min_p up to rounding: the sorted order's 1/sum decides, so with host
    checks the reference runs; without them (a GPU) the cheap answer stands, no sync."""
    import llmserve.sample.filters as filters_module

    calls = []
    real = filters_module.filter_by_sorting
    monkeypatch.setattr(filters_module, "filter_by_sorting", lambda *a: calls.append(1) or real(*a))
    min_p = 0.25
    x = torch.randn(2, 500, generator=torch.Generator().manual_seed(1)) - 5.0
    x[:, 0] = 0.0  # the maximum
    x[:, 1] = torch.log(torch.tensor(min_p))  # exp(x) ~= min_p * exp(0)
    m = torch.tensor([min_p, min_p])
    expected = real(x.clone(), None, None, m)
    assert torch.equal(apply_filters(x.clone(), None, None, m, 0, None, True), expected)
    assert calls == [1]
    apply_filters(x.clone(), None, None, m, 0, None, False)
    assert calls == [1]


def test_without_host_checks_top_k_and_top_p_still_equal_the_reference() -> None:
    rng = random.Random(11)
    for case in range(200):
        x = random_logits(rng, 4, 500, case)
        top_k = [rng.choice([1, 5, 50, 500]) for _ in range(4)]
        top_p = [rng.choice([1.0, 0.5, 0.9]) for _ in range(4)]
        k, p, m, width, sort_rows = filters(top_k, top_p, None, 500)
        got = apply_filters(x.clone(), k, p, m, width, sort_rows, False)
        assert torch.equal(got, filter_by_sorting(x.clone(), k, p, None))
