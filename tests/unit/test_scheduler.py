"""The scheduler as pure Python: fake runner outputs in, scheduling decisions out (no model)."""

from __future__ import annotations

import pytest

from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.core.request import Request, RequestStatus
from llmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from llmserve.core.scheduler import Scheduler
from llmserve.core.scheduler import make_scheduler as build_scheduler
from llmserve.sampling_params import SamplingParams

EOS = 2


def make_scheduler(num_blocks: int = 64, block_size: int = 4, caching: bool = True, **sched) -> Scheduler:
    return build_scheduler(
        SchedulerConfig(**sched),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_kv_blocks=num_blocks,
        max_model_len=256,
    )


def make_request(req_id: str, prompt_len: int, max_tokens: int = 8, first: int = 10, **params) -> Request:
    return Request(
        request_id=req_id,
        prompt_token_ids=list(range(first, first + prompt_len)),
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=frozenset({EOS}),
        max_tokens=max_tokens,
    )


def fake_run(so: SchedulerOutput, sched: Scheduler, token: int = 7) -> ModelRunnerOutput:
    """What a runner would return: a token for every request whose known tokens are all computed."""
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        r = sched.requests[rid]
        sampled.append([token] if r.num_computed_tokens == r.num_tokens else [])
    return ModelRunnerOutput(req_ids, sampled)


def step(sched: Scheduler, token: int = 7):
    so = sched.schedule()
    return so, sched.update_from_output(so, fake_run(so, sched, token))


def test_decodes_first_then_prefill_chunks_within_budget():
    sched = make_scheduler(max_num_batched_tokens=10)
    sched.add_request(make_request("a", 3))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 3}
    sched.add_request(make_request("b", 25, first=100))
    so, _ = step(sched)
    # a decodes (1 token), b gets the remaining 9 of the budget
    assert so.num_scheduled_tokens == {"a": 1, "b": 9}
    assert [n.req_id for n in so.scheduled_new_reqs] == ["b"]
    so, outs = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 9}
    assert [o.req_id for o in outs] == ["a"]  # b is mid-prefill: no token yet
    so, outs = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 7}  # b's last chunk
    assert {o.req_id for o in outs} == {"a", "b"}


def test_max_num_seqs_bounds_the_batch():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 3, first=10 * i))
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    assert len(sched.waiting) == 2


def test_stop_conditions():
    sched = make_scheduler()
    sched.add_request(make_request("eos", 3))
    _, outs = step(sched, token=EOS)
    assert outs[0].finish_reason == "stop" and outs[0].stop_reason is None

    sched.add_request(make_request("min", 3, min_tokens=2, first=50))
    _, outs = step(sched, token=EOS)
    assert outs[0].finish_reason is None  # EOS before min_tokens does not stop
    _, outs = step(sched, token=EOS)
    assert outs[0].finish_reason == "stop"

    sched.add_request(make_request("ign", 3, max_tokens=3, ignore_eos=True, first=60))
    reasons = [step(sched, token=EOS)[1][0].finish_reason for _ in range(3)]
    assert reasons == [None, None, "length"]

    sched.add_request(make_request("stopid", 3, stop_token_ids=[9], first=70))
    _, outs = step(sched, token=9)
    assert outs[0].finish_reason == "stop" and outs[0].stop_reason == 9
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.get_num_free_blocks() == 64


def test_abort_frees_blocks_at_once():
    sched = make_scheduler()
    sched.add_request(make_request("a", 10))
    sched.add_request(make_request("b", 10, first=200))
    step(sched)
    used = 64 - sched.kv_cache_manager.get_num_free_blocks()
    assert used == 6
    sched.finish_requests(["a", "b"])
    assert sched.kv_cache_manager.get_num_free_blocks() == 64
    so = sched.schedule()
    assert so.finished_req_ids == {"a", "b"} and so.is_empty


def test_preemption_takes_the_newest_and_recomputes_it():
    # 6 blocks of 4 tokens; three 7-token prompts take 2 blocks each, then decodes need more.
    sched = make_scheduler(num_blocks=6, caching=False)
    for i, rid in enumerate("abc"):
        sched.add_request(make_request(rid, 7, max_tokens=6, first=20 * i))
    step(sched)  # all three prefilled: 6 blocks used, each holds 7 tokens and sampled an 8th
    step(sched)  # the 8th tokens still fit the second blocks
    so, _ = step(sched)  # the 9th tokens need third blocks: c (newest) is preempted
    assert so.preempted_req_ids == {"c"} and set(so.num_scheduled_tokens) == {"a", "b"}
    assert sched.requests["c"].status == RequestStatus.PREEMPTED
    assert sched.requests["c"].num_computed_tokens == 0
    assert sched.num_preemptions >= 1
    # Everything still completes, c last, with its already-sampled token kept.
    finished = []
    for _ in range(50):
        if not sched.has_unfinished_requests():
            break
        so, outs = step(sched)
        finished += [o.req_id for o in outs if o.finish_reason]
    assert sorted(finished) == ["a", "b", "c"] and finished[-1] == "c"
    assert sched.kv_cache_manager.get_num_free_blocks() == 6


def test_reservation_never_preempts():
    sched = make_scheduler(num_blocks=6, caching=False, admission="reserve")
    for i, rid in enumerate("abc"):
        sched.add_request(make_request(rid, 7, max_tokens=6, first=20 * i))
    so, _ = step(sched)
    # 7 + 6 = 13 tokens = 4 blocks each: only one fits its reservation at a time
    assert set(so.num_scheduled_tokens) == {"a"}
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        assert not so.preempted_req_ids
    assert sched.num_preemptions == 0


def test_static_mode_waits_for_the_whole_batch():
    sched = make_scheduler(mode="static")
    sched.add_request(make_request("short", 3, max_tokens=1))
    sched.add_request(make_request("long", 3, max_tokens=4, first=50))
    step(sched)  # both admitted; short finishes immediately
    sched.add_request(make_request("late", 3, first=90))
    for _ in range(3):
        so, _ = step(sched)
        assert "late" not in so.num_scheduled_tokens
    so, _ = step(sched)
    assert "late" in so.num_scheduled_tokens


def test_static_mode_computes_finished_members_as_padding():
    sched = make_scheduler(mode="static")
    sched.add_request(make_request("short", 3, max_tokens=1))
    sched.add_request(make_request("long", 3, max_tokens=4, first=50))
    _, outs = step(sched)
    assert {o.req_id: o.finish_reason for o in outs} == {"short": "length", "long": None}
    used = sched.kv_cache_manager.get_num_free_blocks()
    for _ in range(3):
        so, outs = step(sched)
        # short keeps its row (and its blocks) but reports nothing more
        assert set(so.num_scheduled_tokens) == {"short", "long"}
        assert [o.req_id for o in outs] == ["long"]
        assert "short" not in so.finished_req_ids
    assert outs[0].finish_reason == "length"
    assert sched.requests == {} and sched.running == []
    assert sched.kv_cache_manager.get_num_free_blocks() > used
    so = sched.schedule()
    assert so.finished_req_ids == {"short", "long"}


def test_static_mode_abort_of_the_last_member_frees_the_padding():
    sched = make_scheduler(mode="static")
    sched.add_request(make_request("short", 3, max_tokens=1))
    sched.add_request(make_request("long", 3, max_tokens=8, first=50))
    step(sched)
    sched.finish_requests(["short"])  # already finished for its user: nothing happens
    assert "short" in sched.requests
    sched.finish_requests(["long"])
    assert sched.requests == {} and sched.running == []
    assert sched.kv_cache_manager.get_num_free_blocks() == 64


def test_static_mode_pads_prompts_to_the_longest_of_the_batch():
    sched = make_scheduler(mode="static", max_num_seqs=2, max_num_batched_tokens=12)
    sched.add_request(make_request("short", 3, max_tokens=2))
    sched.add_request(make_request("long", 9, max_tokens=2, first=50))
    sched.add_request(make_request("next", 5, max_tokens=1, first=90))
    pad = "short#prompt-padding"
    so, outs = step(sched)
    # short, then its 6 pad positions, then what the budget leaves of long; pads are not members
    assert so.num_scheduled_tokens == {"short": 3, pad: 6, "long": 3}
    assert [o.req_id for o in outs] == ["short"]  # the pad's sampled token is nobody's
    # its prefill is done: it left (its blocks are free) and never decodes
    assert pad not in sched.requests and [r.request_id for r in sched.running] == ["short", "long"]
    so, outs = step(sched)
    assert pad in so.finished_req_ids
    assert so.num_scheduled_tokens == {"short": 1, "long": 6}
    assert {o.req_id for o in outs} == {"short", "long"}
    while sched.has_unfinished_requests():
        so, outs = step(sched)
        # "next" is alone in its batch: nothing to pad
        assert not any(r.endswith("#prompt-padding") for r in so.num_scheduled_tokens)
    assert sched.kv_cache_manager.get_num_free_blocks() == 64


def test_static_ragged_mode_does_not_pad_prompts():
    sched = make_scheduler(mode="static-ragged")
    sched.add_request(make_request("short", 3, max_tokens=1))
    sched.add_request(make_request("long", 9, max_tokens=1, first=50))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"short": 3, "long": 9}


def test_static_mode_prompt_padding_gives_way_under_memory_pressure():
    # 8 blocks of 4, 8 tokens a step: long (16 tokens) prefills in two steps; then short and 3 of
    # its 12 pad positions; then the pad's next chunk finds no free block and, being padding,
    # is dropped instead of preempting a member.
    sched = make_scheduler(num_blocks=8, mode="static", max_num_batched_tokens=8)
    sched.add_request(make_request("long", 16, max_tokens=3, first=50))
    sched.add_request(make_request("short", 4, max_tokens=3))
    pad = "short#prompt-padding"
    scheduled = []
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        scheduled.append(so.num_scheduled_tokens)
        assert not so.preempted_req_ids
    assert scheduled[2] == {"long": 1, "short": 4, pad: 3}
    assert pad not in scheduled[3] and "short" in scheduled[3]
    assert sched.num_preemptions == 0 and sched.kv_cache_manager.get_num_free_blocks() == 8


def test_static_mode_aborting_a_waiting_member_drops_its_padding():
    sched = make_scheduler(mode="static", max_num_seqs=2, max_num_batched_tokens=9)
    sched.add_request(make_request("long", 9, max_tokens=2, first=50))
    sched.add_request(make_request("short", 3, max_tokens=2))
    so, _ = step(sched)  # long takes the whole budget; short waits with its pad prepared
    assert so.num_scheduled_tokens == {"long": 9}
    sched.finish_requests(["short"])
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        assert set(so.num_scheduled_tokens) == {"long"}
    assert sched.requests == {} and sched._prompt_pads == {}
    assert sched.kv_cache_manager.get_num_free_blocks() == 64


def test_continuous_mode_admits_while_others_run():
    sched = make_scheduler()
    sched.add_request(make_request("long", 3, max_tokens=4))
    step(sched)
    sched.add_request(make_request("late", 3, first=90))
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"long", "late"}


def test_priority_policy_orders_admission():
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    low, high = make_request("low", 3), make_request("high", 3, first=50)
    low.priority, high.priority = 5, 0
    sched.add_request(low)
    sched.add_request(high)
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"high"}


def test_prefix_cache_hit_is_reported_and_skipped():
    sched = make_scheduler()
    sched.add_request(make_request("a", 13, max_tokens=1))
    step(sched)
    b = make_request("b", 13, max_tokens=1)  # same prompt
    sched.add_request(b)
    so, _ = step(sched)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12  # 3 full blocks reused
    assert so.num_scheduled_tokens == {"b": 1} and b.num_cached_tokens == 12


def test_invalid_scheduler_config():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="admission"):
        SchedulerConfig(admission="lazy")  # type: ignore[arg-type]


def test_static_modes_run_in_their_own_class():
    from llmserve.core.scheduler import Scheduler
    from llmserve.core.static_scheduler import StaticBatchScheduler

    assert type(make_scheduler()) is Scheduler
    assert type(make_scheduler(mode="static-ragged")) is StaticBatchScheduler
    cache = CacheConfig(block_size=4)
    with pytest.raises(ValueError, match="mode 'static' is run by StaticBatchScheduler"):
        Scheduler(SchedulerConfig(mode="static"), cache, num_kv_blocks=8, max_model_len=64)
    with pytest.raises(ValueError, match="StaticBatchScheduler runs the static modes; got mode 'continuous'"):
        StaticBatchScheduler(SchedulerConfig(), cache, num_kv_blocks=8, max_model_len=64)


def _embedding_request(req_id: str, prompt_len: int, pooling: str) -> Request:
    from llmserve.pooling_params import PoolingParams

    request = make_request(req_id, prompt_len)
    request.max_tokens, request.pooling_params = 0, PoolingParams(pooling)  # type: ignore[arg-type]
    return request


def _pooled_run(so: SchedulerOutput, sched: Scheduler) -> ModelRunnerOutput:
    """A runner's output where embedding requests whose prompt is computed return a vector."""
    out = fake_run(so, sched)
    for i, rid in enumerate(out.req_ids):
        r = sched.requests[rid]
        if r.pooling_params is not None:
            out.sampled_token_ids[i] = []
            if r.num_computed_tokens == r.num_tokens:
                out.pooled[rid] = [1.0, 0.0]
    return out


@pytest.mark.parametrize(("pooling", "cached"), [("last", 8), ("mean", 0), ("cls", 0)])
def test_embedding_request_chunks_ends_with_its_prefill_and_uses_the_prefix_cache_only_for_last(
    pooling, cached
):
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add_request(make_request("gen", 10))
    while sched.has_unfinished_requests():
        so = sched.schedule()
        sched.update_from_output(so, fake_run(so, sched))
    sched.add_request(_embedding_request("emb", 10, pooling))  # same prompt: 8 tokens in full blocks cached
    outputs = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        outputs += sched.update_from_output(so, _pooled_run(so, sched))
    assert len(outputs) == 1
    out = outputs[0]
    assert out.embedding == [1.0, 0.0] and out.finish_reason == "stop" and out.new_token_ids == []
    assert out.num_cached_tokens == cached
    assert sched.kv_cache_manager.get_num_free_blocks() == sched.kv_cache_manager.num_blocks


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_that_holds_it_whole():
    """An encoder's scheduler (`chunked_prefill=False`): b (7 tokens) does not fit the 4 left
    after a (6) in a 10-token step, so it waits (c behind it too: queue order) and runs whole
    in the next step instead of as 4 + 3."""
    sched = build_scheduler(
        SchedulerConfig(max_num_batched_tokens=10),
        CacheConfig(block_size=4, enable_prefix_caching=False),
        num_kv_blocks=64,
        max_model_len=10,
        chunked_prefill=False,
    )
    for rid, n in [("a", 6), ("b", 7), ("c", 2)]:
        sched.add_request(_embedding_request(rid, n, "mean"))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 6}
    sched.update_from_output(so, _pooled_run(so, sched))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"b": 7, "c": 2}
    outs = sched.update_from_output(so, _pooled_run(so, sched))
    assert {o.req_id for o in outs} == {"b", "c"} and not sched.has_unfinished_requests()


def test_token_budget_auto_is_resolved_per_path():
    """Unset, the budget is the fused CPU decoder's 256 or everyone else's 1024 once the engine
    knows the path (`for_model`), 1024 before; a given budget is kept."""
    auto = SchedulerConfig()
    assert auto.max_num_batched_tokens is None and auto.token_budget == 1024
    assert auto.for_model(fused_cpu_decoder=True).token_budget == 256
    assert auto.for_model(fused_cpu_decoder=False).token_budget == 1024
    assert SchedulerConfig(max_num_batched_tokens=512).for_model(fused_cpu_decoder=True).token_budget == 512
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        SchedulerConfig(max_num_batched_tokens=0)
