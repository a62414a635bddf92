"""How many proposed tokens each request verifies in the next step: as many as pay for themselves.

A step's time grows with the tokens it computes, t(n) = a + b n (weights streamed once, then
compute per token), and a request whose proposals are each accepted with probability alpha yields
1 + alpha + alpha^2 + ... + alpha^k tokens from k of them. Starting from no proposals, the
controller adds one proposed token at a time to the request whose next one is likeliest to be
kept (gain alpha^(k+1)), while tokens per second still rise:

    (E + gain) / (T + b) > E / T        E: tokens the step yields, T: the step's time

so a lone request with a predictable answer verifies several tokens, one with unpredictable text
none, and a full batch (where T is large but so is E, and b is what one more token costs) only the
near-certain ones. `a` and `b` are fitted online from decode steps' durations (a prior ratio until
the steps vary enough to fit); alpha is each request's own acceptance so far (core/scheduler.py
keeps its decayed counts), starting from the engine's recent acceptance. A request whose first
proposed token could not pay is not even asked for proposals (a draft model's passes cost too),
and one held at zero still verifies one token every `PROBE_INTERVAL` steps (4x that while the
engine's acceptance is below 20%), so its estimate can recover.
"""

from __future__ import annotations

import heapq
from collections import deque

from llmserve.core.request import Request

PROBE_INTERVAL = 16
MAX_STEPS = 256
"""Decode steps the cost fit remembers (running sums, so a step costs O(1) to add)."""
PRIOR_RATIO = {"cpu": 0.3, "cuda": 0.02}
"""b / a before the fit: one more token's cost relative to a step's fixed cost."""


class SpecController:
    def __init__(self, max_k: int, device_type: str = "cpu", adaptive: bool = True) -> None:
        self.max_k = max_k
        self.adaptive = adaptive
        self.prior_ratio = PRIOR_RATIO.get(device_type, 0.3)
        self._steps: deque[tuple[int, float]] = deque()
        self._sums = [0.0, 0.0, 0.0, 0.0]  # of x, t, x^2, x t over `_steps` (x tokens, t seconds)
        self._cost: tuple[float, float] | None = None
        self.prior_alpha = 0.5
        """What a request that has verified nothing yet is assumed to get accepted: the engine's
        recent acceptance (`observe_acceptance`), so a proposer that rarely helps is not asked for
        every new request."""

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode step (no prefill) computed `num_tokens` tokens in `seconds`."""
        self._add(num_tokens, seconds, 1.0)
        self._steps.append((num_tokens, seconds))
        if len(self._steps) > MAX_STEPS:
            self._add(*self._steps.popleft(), -1.0)
        self._cost = None

    def _add(self, x: float, t: float, sign: float) -> None:
        sums = self._sums
        sums[0] += sign * x
        sums[1] += sign * t
        sums[2] += sign * x * x
        sums[3] += sign * x * t

    def observe_acceptance(self, accepted: int, proposed: int) -> None:
        """A step's verifications, engine-wide: they move the prior of requests with no history."""
        if proposed:
            self.prior_alpha = 0.9 * self.prior_alpha + 0.1 * accepted / proposed

    def alpha(self, request: Request) -> float:
        """The chance the request's next proposed token is kept: its own decayed counts, with two
        observations' worth of the engine's prior."""
        return (request.spec_accepted + 2.0 * self.prior_alpha) / (
            request.spec_accepted + request.spec_rejected + 2.0
        )

    @property
    def probe_interval(self) -> int:
        """Steps between probes of a request held at zero: rarer while the engine's acceptance is low."""
        return PROBE_INTERVAL if self.prior_alpha >= 0.2 else 4 * PROBE_INTERVAL

    def cost(self) -> tuple[float, float]:
        """(a, b) of t(n) = a + b n, in seconds; least squares over recent decode steps, or the
        prior ratio when their sizes barely vary."""
        if self._cost is None:
            self._cost = self._fit()
        return self._cost

    def _fit(self) -> tuple[float, float]:
        n = len(self._steps)
        if not n:
            return 1.0, self.prior_ratio
        sx, st, sxx, sxt = self._sums
        mean_x, mean_t = sx / n, st / n
        var_x = sxx / n - mean_x * mean_x
        if var_x >= 0.5:
            b = (sxt / n - mean_x * mean_t) / var_x
            a = mean_t - b * mean_x
            if a > 0 and b > 0:
                return a, b
        a = mean_t / (1 + self.prior_ratio * mean_x)
        return a, self.prior_ratio * a

    def worth_proposing(self, request: Request, num_tokens: int, num_outputs: int) -> bool:
        """Whether a request's first proposed token could pay in a step of `num_tokens` tokens
        yielding `num_outputs` (or it is due for a probe): proposing costs too (a draft model runs
        k forward passes), so requests whose proposals keep failing are not even asked."""
        if not self.adaptive or request.spec_idle >= self.probe_interval:
            return True
        a, b = self.cost()
        return self.alpha(request) * (a + b * num_tokens) > b * max(1, num_outputs)

    def allocate(
        self, candidates: list[tuple[Request, int]], num_tokens: int, num_outputs: int
    ) -> dict[str, int]:
        """Proposed tokens to verify per request: `candidates` are (request, tokens it has on
        offer); the next step computes `num_tokens` without any and yields `num_outputs` tokens."""
        if not self.adaptive:
            return {r.request_id: min(avail, self.max_k) for r, avail in candidates if avail}
        a, b = self.cost()
        total_time = a + b * num_tokens
        gain_total = float(max(1, num_outputs))
        ks: dict[str, int] = {}
        heap: list[tuple[float, int, str]] = []
        alphas: dict[str, float] = {}
        limits: dict[str, int] = {}
        for i, (request, avail) in enumerate(candidates):
            limit = min(avail, self.max_k)
            if limit <= 0:
                continue
            alpha = self.alpha(request)
            rid = request.request_id
            alphas[rid], limits[rid], ks[rid] = alpha, limit, 0
            if request.spec_idle >= self.probe_interval:  # a probe: one token, to refresh the estimate
                ks[rid] = 1
                gain_total += alpha
                total_time += b
            if ks[rid] < limit:
                heapq.heappush(heap, (-(alpha ** (ks[rid] + 1)), i, rid))
        while heap:
            neg_gain, i, rid = heapq.heappop(heap)
            gain = -neg_gain
            if gain * total_time <= b * gain_total:
                break  # the likeliest remaining token no longer pays; the others pay less
            ks[rid] += 1
            gain_total += gain
            total_time += b
            if ks[rid] < limits[rid]:
                heapq.heappush(heap, (-(alphas[rid] ** (ks[rid] + 1)), i, rid))
        return {rid: k for rid, k in ks.items() if k}
