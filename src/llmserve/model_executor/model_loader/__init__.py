"""Load a model named by the user into a native llmserve model.

resolve name -> read config (config.json or GGUF metadata) -> pick the class from the registry
-> build the model with uninitialised tensors on the target device -> stream checkpoint tensors
into it (dequantising GGUF tensors) -> check nothing is missing -> (CUDA, `cpu_offload_gb`) move
whole decoder layers to pinned host memory (offload.py) -> report what was loaded.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from llmserve.config import ModelConfig
from llmserve.distributed import sharding
from llmserve.distributed.sharding import TPShard
from llmserve.layers import onednn
from llmserve.layers.attention import KVDtypes, get_attention_backend
from llmserve.layers.linear import Linear
from llmserve.layers.moe import describe_moe, use_moe_kernel
from llmserve.layers.quantization import (
    Fp8Linear,
    QuantizationPlan,
    QuantizedLinear,
    WeightGroup,
    cpu_kernels,
    quantize_modules,
    weight_groups,
)
from llmserve.layers.quantization.formats import KERNEL_CODES
from llmserve.layers.rotary_embedding import longrope_note, longrope_original_context, rope_for_context
from llmserve.model_executor.device import DeviceProfile, build_profile, resolve_device
from llmserve.model_executor.model_loader import hf_folder
from llmserve.model_executor.model_loader.fused_tensors import split_fused
from llmserve.model_executor.model_loader.hf_quant_config import (
    Target,
    read_checkpoint_quantization,
    resolve_target,
)
from llmserve.model_executor.model_loader.overrides import apply_hf_overrides, with_classifier_token_ids
from llmserve.model_executor.model_loader.prequantized import PrequantizedCheckpoint
from llmserve.model_executor.model_loader.quant_plan import (
    check_supported,
    fp8_kernel_name,
    gguf_tensor_types,
    gguf_type_report,
    plan_quantization,
    use_fp8_kernel,
)
from llmserve.model_executor.model_loader.source import ModelSource, resolve_model
from llmserve.model_executor.model_loader.st_dense import (
    attach_dense_head,
    gguf_dense_stack,
    load_dense_stack,
)
from llmserve.model_executor.offload import LayerOffloader, check_offload_device, offload_layers
from llmserve.models import CausalLM, resolve_model_class
from llmserve.models.registry import HEADLESS, is_supported

if TYPE_CHECKING:
    from llmserve.model_executor.model_loader.gguf_mmproj import GGUFVision

logger = logging.getLogger("llmserve")


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: CausalLM
    hf_config: Any
    source: ModelSource
    dtype: torch.dtype
    device: torch.device
    profile: DeviceProfile
    """The device's decisions: attention backend, dtypes, fused decoder, graphs, host memory."""
    checkpoint_format: str
    """"safetensors", "bin" or "gguf (Q4_1, Q8_0, F32)" - what was on disk."""
    num_params: int
    weight_bytes: int
    load_seconds: float
    max_model_len: int
    linear_kernel: str
    """What runs the linear layers' matmuls: "onednn", "blas" (CPU) or "cuda"; with quantized
    layers, "q4/q8 on <kernel set>" for them."""
    quantization: str = "none"
    """The resolved `ModelConfig.quantization`: "none", "int8", "int4", "fp8", "auto" (a GGUF
    file's types), or a pre-quantized checkpoint's method and what it became:
    "gptq (4-bit, group 128, act-order) -> q4"."""
    weight_groups: tuple[WeightGroup, ...] = ()
    """Weight bytes by role and storage format."""
    gguf_types: str = ""
    """Under quantization auto, what each quantized GGUF type became (quant_plan.gguf_type_report)."""
    model_impl: str = "native"
    """Whose modelling code runs it: "native" (llmserve's) or "transformers"."""
    offloader: LayerOffloader | None = None
    """The decoder layers kept in host memory (`cpu_offload_gb`), or None."""
    moe: str = ""
    """Mixture-of-experts models: layers, experts and active parameters (`layers.moe.describe_moe`)."""
    gguf_vision: GGUFVision | None = None
    """A GGUF model's vision projector file (`mmproj`): the tokens and preprocessing it adds."""

    @property
    def text_config(self) -> Any:
        """The language model's config (a multimodal checkpoint's text config)."""
        return text_config(self.hf_config)

    @property
    def embedding_size(self) -> int:
        """The width of the model's pooled vectors: its Dense layers' output (st_dense.py), else its
        hidden size (0: a config without one)."""
        return int(getattr(self.model, "embedding_size", 0) or getattr(self.text_config, "hidden_size", 0))

    def kv_cache_dtype(self, name: str = "auto") -> KVDtypes:
        """`CacheConfig.kv_cache_dtype` for this model (see `DeviceProfile.kv_cache_dtype`)."""
        # the CPU kernels' formats (q4, q4k, q6, q8) take a 16-bit cache by default; fp8's CPU path is a
        # reference for its GPU numbers: its K/V stay in the model's dtype, as float models' do
        quantized = any(g.fmt in KERNEL_CODES for g in self.weight_groups)
        return self.profile.kv_cache_dtype(name, self.dtype, quantized)

    def summary(self) -> str:
        formats = sorted({g.fmt for g in self.weight_groups if g.role != "other"})
        kinds = ", ".join(formats) or str(self.dtype).removeprefix("torch.")
        text = (
            f"loaded {self.source.name} ({type(self.model).__name__}, {self.checkpoint_format}) in "
            f"{self.load_seconds:.1f} s: {self.num_params / 1e6:.1f}M parameters, "
            f"{self.weight_bytes / 2**20:.0f} MiB of {kinds} weights on {self.device} "
            f"({self.linear_kernel} matmuls), max_model_len {self.max_model_len}"
        )
        if self.quantization != "none":
            text += f"; quantization {self.quantization}: " + ", ".join(
                g.summary() for g in self.weight_groups
            )
        if self.moe:
            text += f"; {self.moe}"
        if self.model_impl == "native":
            text += longrope_note(self.model.config)
        if self.gguf_types:
            text += f"; GGUF types: {self.gguf_types}"
        if self.offloader is not None:
            text += f"; {self.offloader.summary()}"
        return text


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def resolve_cpu_gemm(name: str, profile: DeviceProfile, dtype: torch.dtype) -> str:
    """The linear layers' kernel for `ModelConfig.cpu_gemm` on this device and dtype."""
    if not profile.is_cpu:
        return profile.kind
    if name == "blas":
        return "blas"
    if onednn.available(dtype):
        return "onednn"
    if name == "onednn":
        raise ValueError(
            f"cpu_gemm 'onednn' needs float32 (or bfloat16 where oneDNN supports it) and a working "
            f"oneDNN in torch; this build cannot run {dtype} through it"
        )
    return "blas"


def text_config(hf_config: Any) -> Any:
    """A config's language-model part: a multimodal checkpoint's text config, else the config."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def _max_model_len(config: ModelConfig, hf_config: Any, source: ModelSource) -> int:
    """The user's `max_model_len` (at most the position table), else the model's own limit: a
    sentence-transformers model's `max_seq_length` where it gives one, a LongRoPE model's original
    context (its long factor set stretches the context at some cost to short prompts: asked for
    with `max_model_len`, as vLLM does since its LongRoPE fix), else the position table."""
    hf_config = text_config(hf_config)  # a multimodal config: its language model's limit
    limit = int(
        getattr(hf_config, "max_position_embeddings", 0) or getattr(hf_config, "n_positions", 0) or 2048
    )
    if getattr(hf_config, "model_type", "") in ("roberta", "xlm-roberta"):
        limit -= hf_config.pad_token_id + 1  # its positions count from pad_token_id + 1 (models/bert.py)
    if config.max_model_len is None:
        trained = hf_folder.sentence_max_seq_length(source.path) if source.kind == "hf" else None
        if trained is None:  # LongRoPE: the original context, short factors (rope_for_context)
            trained = longrope_original_context(hf_config)
        return min(limit, trained) if trained is not None else limit
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's maximum context of {limit} tokens"
        )
    return config.max_model_len


def load_model(config: ModelConfig, shard: TPShard | None = None) -> LoadedModel:
    """Load `config.model` (see `resolve_model` for what names a model) onto `config.device`, with
    the attention backend `config.attention_backend` names (auto: the best for that device).
    `shard`: load only this tensor-parallel rank's part (distributed/sharding.py)."""
    start = time.perf_counter()
    source = resolve_model(config.model)
    prequantized: PrequantizedCheckpoint | None = None
    vision: GGUFVision | None = None
    if source.kind == "gguf":
        from llmserve.model_executor.model_loader import gguf_mmproj
        from llmserve.model_executor.model_loader.gguf_loader import GGUFCheckpoint

        ckpt = GGUFCheckpoint(source.gguf_files)
        ckpts = [ckpt]
        if config.mmproj is not None:  # the vision projector file: its tensors follow the model's
            ckpts.append(gguf_mmproj.open_mmproj(config.mmproj))
            vision = gguf_mmproj.gguf_vision(ckpt, ckpts[1])
        hf_config = ckpt.hf_config() if vision is None else vision.hf_config
        num_tensors: int | None = sum(c.num_tensors() for c in ckpts)
        fmt = f"gguf ({', '.join(ckpt.tensor_types())})" + (f" + mmproj {config.mmproj}" if vision else "")
        tensor_types: dict[str, str] | None = gguf_tensor_types([c.hf_tensor_types() for c in ckpts])

        def weights(dtype: torch.dtype, keep_quantized: Any, cut: Any) -> Iterator[tuple[str, Any, str]]:
            stream = itertools.chain.from_iterable(c.iter_weights(dtype, keep_quantized) for c in ckpts)
            # a GGUF tensor is read whole (one at a time), then cut to the rank's part
            return stream if cut is None else ((n, cut(n, t), f) for n, t, f in stream)
    else:
        if config.mmproj is not None:
            raise ValueError(
                f"mmproj {config.mmproj!r} is for GGUF models (llama.cpp's vision projector); "
                f"{source.name} is an HF folder, whose config names its own vision tower"
            )
        hf_config = hf_folder.load_hf_config(source.path)
        fmt, files = hf_folder.weight_files(source.path)
        num_tensors = hf_folder.count_tensors(fmt, files)
        tensor_types = None
        prequantized = _prequantized(hf_config, fmt, files)

        def weights(dtype: torch.dtype, keep_quantized: Any, cut: Any) -> Iterator[tuple[str, Any, str]]:
            if prequantized is not None:  # (never cut: tensor parallelism refuses them)
                return prequantized.weights(hf_folder.iter_weights(fmt, files, None), target, dtype)
            return hf_folder.iter_weights(fmt, files, dtype, cut)

    hf_config = apply_hf_overrides(hf_config, config.hf_overrides_dict())
    archs = getattr(hf_config, "architectures", None)
    if config.model_impl == "transformers" or (
        config.model_impl == "auto" and source.kind == "hf" and not is_supported(archs)
    ):
        from llmserve.model_executor.transformers_runner import load_transformers_model

        if shard is not None:
            raise ValueError(
                f"tensor parallelism does not support the {archs} architecture on transformers' modelling "
                f"code; supported: {', '.join(sharding.SUPPORTED)} (model_impl native)"
            )

        if prequantized is not None:
            raise ValueError(
                f"{source.name} is pre-quantized ({prequantized.quant.describe()}): that needs "
                f"llmserve's own implementation of the architecture, and {archs} runs on transformers'"
            )
        if config.quantization == "fp8" or config.cpu_offload_gb:
            raise ValueError(
                f"quantization 'fp8' and cpu_offload_gb need llmserve's own implementation; {archs} runs "
                f"on transformers' (model_impl {config.model_impl!r})"
            )
        why = "asked for" if config.model_impl == "transformers" else f"no native implementation of {archs}"
        return load_transformers_model(config, source, hf_config, why)
    model_cls = resolve_model_class(archs, str(source.path))
    # a decoder stack saved without its head (an embedding model): its names lack the backbone's
    # prefix, and the head (tied to the embedding, never used) must not be looked for
    unprefixed = source.kind == "hf" and hf_folder.is_backbone_checkpoint(
        fmt, files, f"{model_cls.backbone_name}."
    )
    # ... and a decoder classifier's checkpoint has a `score` head in the LM head's place
    backbone = unprefixed or (bool(archs) and archs[0] in HEADLESS)
    if backbone:
        hf_config = copy.copy(hf_config)
        hf_config.tie_word_embeddings = True
    hf_config = with_classifier_token_ids(hf_config, source)
    device = resolve_device(config.device)
    profile = build_profile(device, config.attention_backend, config.enforce_eager)
    model_hf_config = hf_config
    if shard is not None:
        if prequantized is not None:
            raise ValueError(
                f"tensor parallelism does not split pre-quantized checkpoints ({prequantized.quant.describe()}) yet"
            )
        sharding.check_supported(model_cls, hf_config, shard.size)
        model_hf_config = sharding.local_config(hf_config, shard.size)
    dtype = profile.model_dtype(config.dtype, hf_config)
    if config.cpu_offload_gb > 0:
        check_offload_device(profile)  # before loading, not after
        # the offloader re-points whole layers' parameters at staging slots; the Triton MoE
        # kernel reads stacked copies it would not move: offloaded experts run the dense path
        profile = dataclasses.replace(profile, moe_kernel="dense")  # (offloading is CUDA only)
    max_model_len = _max_model_len(config, hf_config, source)
    model_hf_config = rope_for_context(model_hf_config, max_model_len)  # LongRoPE's factor set
    linear_kernel = resolve_cpu_gemm(config.cpu_gemm, profile, dtype)

    # Parameters are created with torch.empty (no initialisation pass) directly on the target
    # device; each checkpoint tensor is then copied into its place exactly once.
    with torch.device(device), _default_dtype(dtype):
        model = model_cls(model_hf_config, get_attention_backend(profile.attention_backend, device))
        if backbone:
            model.pooling_only = True
            model.unprefixed_checkpoint = unprefixed
        # Quantized layers replace float ones before loading: the float tensors were never written.
        target: Target = "float"
        if prequantized is None:
            plan = plan_quantization(config.quantization, model, device, dtype, tensor_types)
        else:
            target = resolve_target(prequantized.quant, config.quantization, device, dtype)
            plan = _prequantized_plan(prequantized, target, model, device, dtype)
        if plan is not None:
            quantize_modules(model, plan)

    def keep_quantized(hf_name: str) -> bool:  # GGUF blocks go to quantized layers as they are
        route = model.route_weight(hf_name)
        return plan is not None and route is not None and plan.format_of(route[0]) is not None

    bar = tqdm(
        total=num_tensors, desc=f"Loading {source.name}", unit="tensor", disable=not config.show_progress
    )
    cut = None if shard is None else functools.partial(sharding.shard_tensor, model, shard=shard)
    splits = model_cls.checkpoint_splits(hf_config)
    # a rank's part is read alone where the checkpoint stores tensors as the model loads them; a
    # fused or stacked tensor is read whole and the rank's part cut from its parts
    cut_parts = cut is not None and (bool(splits) or model_cls.regroups_checkpoint)
    with bar:
        stream = weights(dtype, keep_quantized, None if cut_parts else cut)
        stream = _tracked(stream, bar)  # (the bar counts the checkpoint's tensors, not their parts)
        stream = model_cls.regroup_checkpoint(split_fused(stream, splits) if splits else stream)
        if cut_parts:
            assert cut is not None
            stream = ((name, cut(name, tensor), file) for name, tensor, file in stream)
        model.load_weights(stream)
    model.eval()
    # sentence-transformers' Dense layers after the pooling (EmbeddingGemma's)
    dense = load_dense_stack(source.path, device) if source.kind == "hf" else gguf_dense_stack(ckpt, device)
    attach_dense_head(model, dense, int(getattr(hf_config, "hidden_size", 0)), str(source.path))
    if shard is not None:
        sharding.parallelize(model, shard, int(hf_config.vocab_size))
    # int8 only when asked: it changes the model's answers (the default keeps them, STYLE.md 16)
    int8_activations = config.cpu_activations == "int8"
    for m in model.modules():
        if hasattr(m, "act_bits"):  # the quantized linear layers and LM head
            m.act_bits = 8 if int8_activations else 16
    if linear_kernel == "onednn":
        model.use_onednn()  # same bytes, reordered; packed tensors stay parameters
    if plan is not None and "fp8" in plan.formats.values():
        use_fp8_kernel(model, device)
    moe_kernels = use_moe_kernel(model, profile.moe_kernel)  # after fp8 / oneDNN: they decide it
    if plan is not None:
        kernels = plan.kernel or cpu_kernels.kernels()
        linear_kernel = f"{'/'.join(sorted(set(plan.formats.values())))} on {kernels}" + (
            f", float on {linear_kernel}"
            if any(
                isinstance(m, Linear) and not isinstance(m, (QuantizedLinear, Fp8Linear))
                for m in model.modules()
            )
            else ""
        )
        if int8_activations and "q4" in plan.formats.values():
            if cpu_kernels.kernels() == "avx512_vnni":
                linear_kernel += ", q4 with int8 activations"
            else:
                logger.warning(
                    "cpu_activations int8 needs the avx512_vnni kernels (this process runs %s): "
                    "activations stay int16",
                    cpu_kernels.kernels(),
                )

    groups = tuple(weight_groups(model))
    offloader = None
    if config.cpu_offload_gb > 0:
        offloader = offload_layers(model, int(config.cpu_offload_gb * 2**30), profile)
    loaded = LoadedModel(
        model=model,
        hf_config=hf_config,
        source=source,
        dtype=dtype,
        device=device,
        checkpoint_format=fmt,
        num_params=_num_params(model),
        weight_bytes=sum(g.num_bytes for g in groups),
        load_seconds=time.perf_counter() - start,
        max_model_len=max_model_len,
        linear_kernel=linear_kernel,
        quantization=_quantization_label(plan, prequantized, target),
        weight_groups=groups,
        gguf_types=gguf_type_report(tensor_types)
        if plan is not None and plan.method == "auto" and tensor_types
        else "",
        profile=profile,
        offloader=offloader,
        moe=", ".join(filter(None, (describe_moe(model), moe_kernels))),
        gguf_vision=vision,
    )
    logger.info(loaded.summary())
    return loaded


def _prequantized(hf_config: Any, fmt: str, files: list) -> PrequantizedCheckpoint | None:
    """The checkpoint's own quantization (GPTQ, AWQ, FP8), or None for a float checkpoint."""
    quant = read_checkpoint_quantization(hf_config)
    if quant is None:
        return None
    if fmt != "safetensors":
        raise ValueError(f"pre-quantized checkpoints ({quant.describe()}) are read from safetensors only")
    return PrequantizedCheckpoint.scan(quant, hf_folder.tensor_dtypes(files))


def _prequantized_plan(
    ckpt: PrequantizedCheckpoint, target: Target, model: CausalLM, device: torch.device, dtype: torch.dtype
) -> QuantizationPlan | None:
    if target in ("q4", "q8"):  # an explicit int4/int8 where the CPU kernels cannot run is refused
        check_supported("int4" if target == "q4" else "int8", device, dtype)
    return ckpt.plan(target, model, fp8_kernel_name(device) if target == "fp8" else "")


def _quantization_label(
    plan: QuantizationPlan | None, ckpt: PrequantizedCheckpoint | None, target: str
) -> str:
    if ckpt is not None:
        return f"{ckpt.quant.describe()} -> {'float (dequantized)' if target == 'float' else target}"
    return "none" if plan is None else plan.method


def _num_params(model: torch.nn.Module) -> int:
    """Parameters as the checkpoint counts them: a quantized matrix counts its logical elements."""
    params = {id(p): p for p in model.parameters()}.values()  # tied tensors once
    total = sum(p.numel() for p in params)
    seen: set[int] = set()
    for m in model.modules():
        w = getattr(m, "qweight", None)
        if w is not None and id(w) not in seen:
            seen.add(id(w))
            total += w.out_features * w.in_features
        if isinstance(m, QuantizedLinear) and w is None:  # split by its shards' formats
            total += sum(p.out_features * p.in_features for p in m.parts)
        if isinstance(m, Fp8Linear):  # its scales are not checkpoint parameters
            total -= m.weight_scale.numel()
    return total


def _tracked(
    weights: Iterator[tuple[str, torch.Tensor, str]], bar: tqdm
) -> Iterator[tuple[str, torch.Tensor, str]]:
    for item in weights:
        bar.update(1)
        yield item


__all__ = ["LoadedModel", "ModelSource", "load_model", "resolve_model"]
