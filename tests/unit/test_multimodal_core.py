"""Images in the scheduler and the prefix cache (core/multimodal.py), as pure Python: an image's
tokens never split across fresh prefill chunks (unless attended causally), and its hash is part of its blocks' identity."""

from __future__ import annotations

from llmserve.core.kv_cache.block_hash import request_block_hashes
from llmserve.core.multimodal import MultiModalInput, block_extra_keys, cut_chunk
from tests.unit.test_scheduler import fake_run, make_request, make_scheduler


def image(offset: int, length: int = 6, name: str = "a") -> MultiModalInput:
    return MultiModalInput(offset, length, name)


def test_cut_chunk_stops_before_an_image_or_takes_it_whole() -> None:
    images = (image(4), image(12))  # tokens [4, 10) and [12, 18)
    assert cut_chunk(images, 0, 4) == 4  # ends where the image begins
    assert cut_chunk(images, 0, 7) == 4  # would end inside: cut before it
    assert cut_chunk(images, 0, 10) == 10  # takes it whole
    assert cut_chunk(images, 0, 14) == 12  # the second one is cut off
    assert cut_chunk(images, 6, 2) == 0  # starts inside (a cache hit): the rest whole or nothing
    assert cut_chunk(images, 6, 4) == 4
    assert cut_chunk(images, 20, 3) == 3


def test_cut_chunk_splits_an_image_attended_causally() -> None:
    """Qwen2.5-VL's images attend like text: a chunk may end anywhere in one; a both-ways image
    after it still cuts."""
    causal = MultiModalInput(4, 6, "a", bidirectional=False)
    assert cut_chunk((causal,), 0, 7) == 7
    assert cut_chunk((causal,), 6, 2) == 2
    assert cut_chunk((causal, image(12)), 0, 14) == 12


def test_blocks_holding_an_image_carry_its_hash() -> None:
    assert block_extra_keys((image(4),), 0, 4) == ()
    assert block_extra_keys((image(4),), 8, 12) == (("image", "a"),)
    assert block_extra_keys((image(4),), 10, 14) == ()

    def hashes(name: str) -> list[int]:
        r = make_request("r", 16)
        r.mm_inputs = (image(4, name=name),)
        return request_block_hashes(r, 4)

    a, b = hashes("a"), hashes("b")
    assert a[0] == b[0]  # the text before the image is shared
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))  # nothing from the image on


def test_scheduler_never_ends_a_prefill_chunk_inside_an_image() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    r = make_request("r", 20)
    r.mm_inputs = (image(5, length=8),)  # tokens [5, 13)
    sched.add_request(r)
    chunks = []
    while not r.output_token_ids:
        so = sched.schedule()
        chunks.append(so.num_scheduled_tokens.get("r", 0))
        sched.update_from_output(so, fake_run(so, sched))
    assert chunks == [5, 8, 7]  # [0, 5) before the image, the image whole, the rest
