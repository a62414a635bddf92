"""The real Scheduler under random arrivals, aborts and sampled tokens, in every batching mode and
admission policy, on pools small enough to preempt: after each step the block pool matches the
requests' block tables, padding is never reported to anyone, and at the end every request has
finished exactly once with a length its parameters allow, and every block is free."""

from __future__ import annotations

from collections import Counter

from hypothesis import event, given, settings
from hypothesis import strategies as st

from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.core.request import Request
from llmserve.core.sched_output import ModelRunnerOutput
from llmserve.core.scheduler import Scheduler, make_scheduler
from llmserve.sampling_params import SamplingParams

EOS = 2
MAX_MODEL_LEN = 48

REQUEST = st.tuples(
    st.integers(1, 20), st.integers(1, 8), st.booleans()
)  # prompt len, max_tokens, ignore_eos
EVENT = st.one_of(
    st.tuples(st.just("add"), st.lists(REQUEST, min_size=1, max_size=3)),
    st.tuples(st.just("step"), st.lists(st.sampled_from([EOS, 5, 6, 7]), min_size=1, max_size=4)),
    st.tuples(st.just("abort"), st.integers(0, 99)),
)


def check_pool(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    holders: Counter[int] = Counter()
    for r in sched.running:
        table = kv.get_block_ids(r.request_id)
        assert len(table) == len(set(table)), f"{r.request_id} holds a block twice"
        holders.update(table)
    for r in sched.waiting:
        assert kv.get_block_ids(r.request_id) == []
    for block in kv.block_pool.blocks:
        assert block.ref_cnt == holders[block.block_id], f"block {block.block_id}"
    used = sum(1 for b in kv.block_pool.blocks if b.ref_cnt > 0)
    assert kv.get_num_free_blocks() + used == kv.block_pool.num_blocks
    assert set(sched.requests) == {r.request_id for r in sched.running} | {
        r.request_id for r in sched.waiting
    }


@settings(max_examples=400, deadline=None)
@given(
    mode=st.sampled_from(["continuous", "static", "static-ragged"]),
    admission=st.sampled_from(["optimistic", "reserve"]),
    # 8 blocks of 4 hold the longest request (20 + 12 tokens) alone
    num_blocks=st.integers(8, 14),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 6),
    caching=st.booleans(),
    first=st.lists(REQUEST, min_size=2, max_size=8),
    events=st.lists(EVENT, max_size=30),
)
def test_scheduler_invariants(mode, admission, num_blocks, budget, max_num_seqs, caching, first, events):
    sched = make_scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, admission=admission, mode=mode
        ),
        CacheConfig(block_size=4, enable_prefix_caching=caching),
        num_kv_blocks=num_blocks,
        max_model_len=MAX_MODEL_LEN,
    )
    params: dict[str, SamplingParams] = {}
    produced: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    aborted: set[str] = set()
    tokens = [7]

    def add(spec) -> None:
        n, max_tokens, ignore_eos = spec
        req_id = f"r{len(params)}"
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        # A tiny alphabet: prompts share prefixes, so prefix-cache hits happen.
        prompt = [10 + (i * len(params)) % 3 for i in range(n)]
        sched.add_request(Request(req_id, prompt, sp, eos_token_ids=frozenset({EOS}), max_tokens=max_tokens))
        params[req_id], produced[req_id] = sp, []

    def step() -> None:
        so = sched.schedule()
        assert so.total_num_scheduled_tokens <= budget
        members = [r for r in so.num_scheduled_tokens if not sched.requests[r].prompt_padding]
        assert len(members) <= max_num_seqs
        if so.preempted_req_ids:
            event(f"{mode}: preempted")
        if so.finished_req_ids - set(params):
            event("padding left")
        if any(sched.requests[r].prompt_padding for r in so.num_scheduled_tokens):
            event("prompt padding scheduled")
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for i, rid in enumerate(req_ids):
            r = sched.requests[rid]
            sampled.append([tokens[i % len(tokens)]] if r.num_computed_tokens == r.num_tokens else [])
        for out in sched.update_from_output(so, ModelRunnerOutput(req_ids, sampled)):
            assert out.req_id in params, f"padding {out.req_id} reported"
            assert out.req_id not in finished, f"{out.req_id} reported after it finished"
            produced[out.req_id] += out.new_token_ids
            if out.finish_reason is not None:
                finished[out.req_id] = out.finish_reason
        check_pool(sched)

    for kind, arg in [("add", first), *events]:
        if kind == "add":
            for spec in arg:
                add(spec)
        elif kind == "step":
            tokens = arg
            step()
        elif params:
            req_id = f"r{arg % len(params)}"
            if req_id not in finished:
                aborted.add(req_id)
            sched.finish_requests([req_id])
            check_pool(sched)
    tokens = [7]
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        step()
    assert not sched.has_unfinished_requests()
    assert sched.requests == {} and sched.running == []
    assert sched.kv_cache_manager.get_num_free_blocks() == num_blocks
    for req_id, sp in params.items():
        out = produced[req_id]
        assert len(out) <= sp.max_tokens
        if req_id in aborted:
            continue
        assert req_id in finished, f"{req_id} never finished"
        if finished[req_id] == "stop":
            assert out[-1] == EOS and not sp.ignore_eos
        else:
            assert len(out) == sp.max_tokens or len(out) + 1 >= MAX_MODEL_LEN
