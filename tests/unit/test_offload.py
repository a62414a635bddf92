"""CPU offloading (model_executor/offload.py) without a GPU: which layers a budget picks, the
prefetch schedule, and the real mechanism on the CPU with copies done in place (`SyncCopies`):
layers sharing a staging slot share memory, so the outputs are bitwise the plain model's only if
every copy lands after the slot's last reader and before its next one. The flag itself is refused
on the CPU."""

from __future__ import annotations

import argparse

import pytest
import torch
import transformers

from llmserve.cli.engine_args import add_engine_args, llm_kwargs
from llmserve.config import ModelConfig
from llmserve.config.engine_args import EngineArgs
from llmserve.model_executor.forward_runner import ForwardRunner, SequenceBatchEntry
from llmserve.model_executor.model_loader import load_model
from llmserve.model_executor.offload import (
    LayerOffloader,
    SyncCopies,
    choose_layers,
    decoder_layers,
    layer_bytes,
    num_slots_for,
    prefetch_schedule,
)
from tests.models.tiny import _LLAMA_LIKE, make_tiny_model, save_tiny_tokenizer

PROMPTS = [[5, 17, 99, 3], [200, 1, 1, 45, 67, 300, 12, 9, 8, 7, 6, 5, 4, 3, 2, 11, 400, 401, 402, 25]]


@pytest.mark.parametrize(
    ("budget_layers", "want"),
    [(0.5, ()), (1, (8,)), (2, (4, 12)), (4, (2, 6, 10, 14)), (5.9, (1, 4, 8, 11, 14)),
     (8, (1, 3, 5, 7, 9, 11, 13, 15)), (16, tuple(range(16))), (100, tuple(range(16)))],
)  # fmt: skip
def test_layers_are_evenly_spaced_and_centred(budget_layers, want):
    assert choose_layers([1000] * 16, int(budget_layers * 1000)) == want


def test_uneven_layers_stay_within_the_budget():
    sizes = [10, 50, 10, 50, 10, 50]
    chosen = choose_layers(sizes, 70)
    assert sum(sizes[i] for i in chosen) <= 70 and len(chosen) == 2


def test_two_slots_only_once_they_free_memory():
    assert [num_slots_for(k) for k in (1, 2, 3, 4, 16)] == [1, 1, 1, 2, 2]


@pytest.mark.parametrize("num_slots", [1, 2, 3])
@pytest.mark.parametrize(
    "offloaded", [(0,), (0, 1, 2, 3), (2, 6, 10, 14), (1, 3, 5, 7, 9, 11, 13, 15), (15,)]
)
def test_schedule_copies_each_layer_once_into_a_free_slot(offloaded, num_slots):
    """Run the schedule over the stack: every offloaded layer is copied exactly once per forward,
    before it runs, into a slot whose previous occupant has already run."""
    S = min(num_slots, len(offloaded))
    steps = prefetch_schedule(16, offloaded, S)
    slot_holds: dict[int, int] = {}  # slot -> offloaded position copied into it last
    done: set[int] = set()
    copied: list[int] = []

    def copy(j: int) -> None:
        prev = slot_holds.get(j % S)
        assert prev is None or prev in done, f"copy {j} overwrites {prev} before it ran"
        slot_holds[j % S] = j
        copied.append(j)

    for i, step in enumerate(steps):
        for j in step.first:
            copy(j)
        if i in offloaded:
            j = offloaded.index(i)
            assert step.wait == j and slot_holds[j % S] == j
        done.add(offloaded.index(i)) if i in offloaded else None
        if step.then is not None:
            copy(step.then)
    assert copied == list(range(len(offloaded)))


# -- the mechanism on the CPU ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A tiny Llama with 8 layers (the shared tiny ones have 2)."""
    folder = tmp_path_factory.mktemp("offload-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**_LLAMA_LIKE, "num_hidden_layers": 8}, tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return folder


def _load(folder):
    # blas: plain parameter tensors (oneDNN's packed weights are opaque to byte views)
    return load_model(ModelConfig(model=str(folder), device="cpu", cpu_gemm="blas", show_progress=False))


def _run(loaded) -> list[torch.Tensor]:
    """Prefill logits of each prompt, then one decode step of both together."""
    runner = ForwardRunner(loaded.model, num_blocks=32, block_size=4, profile=loaded.profile)
    tables = [list(range(0, 8)), list(range(8, 16))]
    out = [
        runner.execute([SequenceBatchEntry(p, len(p), t)], all_logits=True)
        for p, t in zip(PROMPTS, tables, strict=True)
    ]
    decode = [SequenceBatchEntry([7], len(p) + 1, t) for p, t in zip(PROMPTS, tables, strict=True)]
    return [*out, runner.execute(decode)]


class RecordingCopies(SyncCopies):
    def __init__(self, log: list[tuple[str, int]]) -> None:
        self.log = log

    def copy(self, slot: int, dst: torch.Tensor, src: torch.Tensor, after_use: bool) -> None:
        self.log.append(("copy", slot))
        super().copy(slot, dst, src, after_use)


@pytest.mark.parametrize(
    ("offloaded", "num_slots"), [((1, 3, 5, 7), 2), ((0, 2, 4, 6), 1), ((3, 4), 1), (tuple(range(8)), 2)]
)
def test_offloaded_stack_gives_bitwise_the_same_outputs(deep, offloaded, num_slots):
    want = _run(_load(deep))
    loaded = _load(deep)
    layers = decoder_layers(loaded.model)
    assert layers is not None and len(layers) == 8
    log: list[tuple[str, int]] = []
    offloader = LayerOffloader(layers, offloaded, RecordingCopies(log), torch.device("cpu"), False, num_slots)
    for i, layer in enumerate(layers):  # after the offloader's own hooks
        layer.register_forward_pre_hook(lambda m, a, i=i: log.append(("run", i)))
    got = _run(loaded)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    # Prefetch order within one forward: copy j before layer o_j runs, after o_{j-S} ran.
    first = log[: log.index(("run", 7)) + 1]
    copies = [k for k, e in enumerate(first) if e[0] == "copy"]
    assert len(copies) == len(offloaded)
    for j, i in enumerate(offloaded):
        assert copies[j] < first.index(("run", i))
        if j >= offloader.num_slots:
            assert copies[j] > first.index(("run", offloaded[j - offloader.num_slots]))
    assert [first[k][1] for k in copies] == [j % offloader.num_slots for j in range(len(offloaded))]


def test_fp8_layers_offload_too(deep):
    """e4m3 weights and their float32 scales are parameters like any other: byte views of a slot."""
    kw = dict(model=str(deep), device="cpu", quantization="fp8", cpu_gemm="blas", show_progress=False)
    want = _run(load_model(ModelConfig(**kw)))
    loaded = load_model(ModelConfig(**kw))
    LayerOffloader(decoder_layers(loaded.model), (1, 3, 5, 7), SyncCopies(), torch.device("cpu"), False)
    assert loaded.model.model.layers[3].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    for g, w in zip(_run(loaded), want, strict=True):
        assert torch.equal(g, w)


def test_layers_sharing_a_slot_share_memory(deep):
    """Without the hooks, a layer runs on whatever its slot last received: the outputs change. So
    the equality above holds only because the copies are right."""
    want = _run(_load(deep))
    loaded = _load(deep)
    layers = decoder_layers(loaded.model)
    offloader = LayerOffloader(layers, (1, 3, 5, 7), SyncCopies(), torch.device("cpu"), False, 2)
    q1 = layers[1].self_attn.qkv_proj.weight
    q5 = layers[5].self_attn.qkv_proj.weight
    slot = offloader.slots[0]
    assert q1.data_ptr() == q5.data_ptr()
    assert slot.data_ptr() <= q1.data_ptr() < slot.data_ptr() + slot.numel()
    _run(loaded)
    offloader.remove()
    assert not torch.equal(_run(loaded)[0], want[0])


def test_accounting(deep):
    loaded = _load(deep)
    layers = decoder_layers(loaded.model)
    size = layer_bytes(layers[0])
    params = sum(p.numel() * p.element_size() for p in layers[0].parameters())
    assert params <= size < params + 256 * 16
    offloader = LayerOffloader(layers, (1, 3, 5, 7), SyncCopies(), torch.device("cpu"), False)
    assert offloader.num_slots == 2
    assert offloader.host_bytes == 4 * size and offloader.staging_bytes == 2 * size
    assert "4 of 8 decoder layers (1, 3, 5, 7)" in offloader.summary()


def test_decoder_stack_of_other_architectures(tmp_path):
    make_tiny_model("gpt2", tmp_path)
    model = _load(tmp_path).model
    layers = decoder_layers(model)
    assert len(layers) == 2 and layers[0] is model.transformer.h[0]


# -- the flag -------------------------------------------------------------------------------------------


def test_flag_is_refused_on_the_cpu(deep):
    with pytest.raises(ValueError, match="cpu_offload_gb needs a CUDA device"):
        ModelConfig(model=str(deep), device="cpu", cpu_offload_gb=1)
    if not torch.cuda.is_available():  # auto resolves to the CPU: refused before loading
        with pytest.raises(ValueError, match="cpu_offload_gb needs a CUDA device"):
            load_model(ModelConfig(model=str(deep), cpu_offload_gb=1, show_progress=False))


def test_flag_from_every_source():
    assert EngineArgs.from_options({"cpu_offload_gb": "1.5", "device": "cuda"}).cpu_offload_gb == 1.5
    with pytest.raises(ValueError, match="cpu_offload_gb must be >= 0"):
        EngineArgs.from_options({"cpu_offload_gb": -1})
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--cpu-offload-gb", "2", "--quantization", "fp8"])
    kw = llm_kwargs(args)
    assert kw["cpu_offload_gb"] == 2.0 and kw["quantization"] == "fp8"
