"""`ModelManager`: the models one server serves, loaded on demand and unloaded when idle or when
another needs the room.

    request(model) -> resolve(name:tag | alias) -> slot -> lease: load if needed (waiting, bounded),
                      count the request, route to the slot's engine -> release

A slot's states: unloaded -> loading -> loaded -> unloaded (idle past its keep-alive, evicted, or
unloaded by an operator); a load that fails leaves the slot `failed` (its requests get a 503 that
says why) and the other models serving; a request after `FAILED_RETRY_SECONDS` tries again.

Room: at most `max_loaded_models` native models are loaded, and their sizes (weights + KV cache) sum
to at most `models_memory`. Loading a model first unloads the least recently used idle ones until it
fits; when every loaded model is busy, the load waits for one to go idle. A model's size is estimated
from its files and KV budget before its first load, and measured after it. Loads run one at a time.

Remote (`openai`) models hold no local memory: they are always "loaded" and never evicted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from llmserve.config import ServerConfig
from llmserve.config.engine_args import EngineArgs
from llmserve.config.lora import lora_module_entries
from llmserve.config.models import ModelSpec, check_specs, split_tag
from llmserve.engine.async_engine import AsyncEngine
from llmserve.engine.llm import engine_from_args
from llmserve.lora import LoRARequest, module_requests
from llmserve.metrics.loggers import LoggingStatLogger
from llmserve.metrics.prometheus import MetricFamilies, PrometheusStatLogger
from llmserve.metrics.tracing import RequestTracer
from llmserve.server.errors import APIError
from llmserve.server.model_files import (
    engine_args,
    estimate_size,
    files_digest,
    release_memory,
    weight_files,
)
from llmserve.server.remote import RemoteModel
from llmserve.server.serving import ServingContext

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider  # the optional `otel` extra

logger = logging.getLogger("llmserve.server")

UNLOADED, LOADING, LOADED, FAILED = "unloaded", "loading", "loaded", "failed"
FAILED_RETRY_SECONDS = 30.0
"""A failed model is tried again by the first request this long after the failure (or at once by
an operator's load)."""
REAP_INTERVAL = 0.5
"""Seconds between checks for models idle past their keep-alive."""
T = TypeVar("T")


class ModelSlot:
    """One configured model and what is loaded for it."""

    def __init__(self, spec: ModelSpec, args: EngineArgs | None) -> None:
        self.spec = spec
        self.args = args
        """The local engine's options (the command line's, then the spec's own); None: remote."""
        self.state = UNLOADED
        self.ctx: ServingContext | None = None
        self.remote: RemoteModel | None = None
        self.error: BaseException | None = None
        self.failed_at = 0.0
        self.loading: asyncio.Future[None] | None = None
        self.leases = 0
        self.last_used = time.monotonic()
        self.keep_alive: float | None = None
        """The latest request's keep-alive (Ollama's), over the spec's and the server's."""
        self.metrics: PrometheusStatLogger | None = None
        self.files = weight_files(spec.source) if not self.is_remote else []
        self.file_bytes = sum(p.stat().st_size for p in self.files)
        """The weight files' size on disk (what Ollama's clients read as a model's `size`)."""
        self.memory_bytes: int | None = None
        """Measured at the last load: weights + KV cache."""
        self.vram_bytes = 0
        """The part of `memory_bytes` in GPU memory (all of it on a GPU, none on the CPU)."""
        self.digest: str | None = None
        self.loaded_at: float | None = None
        self.load_seconds: float | None = None
        self.num_loads = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def is_remote(self) -> bool:
        return self.spec.engine == "openai"

    @property
    def engine(self) -> str:
        """What runs the model: once loaded, the implementation that does (`transformers` for a
        native model whose architecture has none of its own); before, the spec's engine."""
        if self.ctx is not None:
            return self.ctx.model_impl
        return self.spec.engine

    @property
    def busy(self) -> bool:
        if self.leases:
            return True
        if self.ctx is not None and self.ctx.engine.num_active:
            return True
        return self.remote is not None and self.remote.num_active > 0

    @property
    def estimate_bytes(self) -> int:
        """Memory the model takes once loaded: measured at its last load, or else estimated (see
        `estimate_size`)."""
        if self.memory_bytes is not None:
            return self.memory_bytes
        assert self.args is not None, "a remote model holds no local memory"
        return estimate_size(self.spec.source, self.file_bytes, self.args)

    def keep_alive_seconds(self, default: float) -> float:
        for value in (self.keep_alive, self.spec.keep_alive):
            if value is not None:
                return value
        return default

    def expires_at(self, default: float) -> float | None:
        """Wall-clock time the model unloads if nothing uses it (None: loaded until evicted)."""
        if self.state != LOADED or self.is_remote:
            return None
        keep = self.keep_alive_seconds(default)
        if math.isinf(keep):
            return None
        idle_since = time.monotonic() if self.busy else self.last_used
        return time.time() + (idle_since - time.monotonic()) + keep


class ModelManager:
    """The server's models: resolution by name, loading, eviction and keep-alive."""

    def __init__(
        self,
        specs: list[ModelSpec],
        config: ServerConfig,
        engine_options: dict[str, Any] | None = None,
        families: MetricFamilies | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        """`tracer_provider`: an OpenTelemetry `TracerProvider` that every loaded engine traces
        its requests through (metrics/tracing.py); None: no tracing."""
        if not specs:
            raise ValueError("a server needs at least one model")
        check_specs(specs)
        self.config = config
        self.families = families
        self.tracer_provider = tracer_provider
        base = dict(engine_options or {})
        base.pop("model", None)
        names = {name for s in specs for name in s.names}
        for adapter, _, model in lora_module_entries(base.get("lora_modules")):
            if model is not None and model not in names:
                raise ValueError(
                    f"lora_modules: {adapter!r} names base_model_name {model!r}, which is no served model"
                )
        self.slots = [ModelSlot(s, engine_args(s, base)) for s in specs]
        self._by_name = {name: slot for slot in self.slots for name in slot.spec.names}
        self.adapters = _adapters(self.slots, self._by_name)
        """LoRA adapter name -> (its base model's slot, the adapter): `--lora-modules`, then
        those loaded at run time (server/lora_adapters.py)."""
        self.next_lora_id = 1 + max((r.lora_int_id for _, r in self.adapters.values()), default=0)
        """The id of the next adapter loaded at run time: ids are never reused, since an id keys
        the prefix cache's blocks and an engine's loaded weights."""
        self.default = self.slots[0]
        self._lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[Any]] = []
        self.started_up = False
        """True once every preloaded model has loaded (or failed)."""
        self.on_preload_error: Callable[[ModelSlot, BaseException], None] | None = None
        self.on_engine_dead: Callable[[ModelSlot, BaseException], None] | None = None
        self.closed = False

    # -- names ----------------------------------------------------------------------------------------

    def resolve_base(self, name: str | None) -> ModelSlot:
        """`resolve`, where a LoRA adapter's name stands for its base model's slot."""
        adapter = self.adapters.get(name) if name is not None else None
        return adapter[0] if adapter is not None else self.resolve(name)

    def resolve(self, name: str | None) -> ModelSlot:
        """The slot a request's `model` names: a name or alias, `name:latest` for a name without a
        tag, or a name without a tag for its default version. 404 otherwise."""
        if name is None:
            return self.default
        slot = self._by_name.get(name)
        if slot is not None:
            return slot
        base, tag = split_tag(name)
        if tag == "latest":  # Ollama: `name` and `name:latest` are one name
            name, tag = base, None
            if base in self._by_name:
                return self._by_name[base]
        if tag is None:
            versions = [s for s in self.slots if s.spec.base == name]
            chosen = (
                [s for s in versions if s.spec.default]
                or [s for s in versions if s.spec.tag == "latest"]
                or (versions if len(versions) == 1 else [])
            )
            if chosen:
                return chosen[0]
            if versions:
                raise APIError(
                    404, f"the model {name!r} has several versions and none is the default; name one of "
                    f"{', '.join(repr(s.name) for s in versions)}", param="model", code="model_not_found",
                )  # fmt: skip
        served = ", ".join(repr(s.name) for s in self.slots)
        raise APIError(
            404, f"the model {name!r} was not found; this server serves {served}",
            param="model", code="model_not_found",
        )  # fmt: skip

    # -- life cycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Preload (in order), then watch keep-alives; call on the server's event loop."""
        self._tasks.append(asyncio.create_task(self._preload()))
        self._tasks.append(asyncio.create_task(self._reap()))
        self._tasks.append(asyncio.create_task(self._digests()))

    async def _preload(self) -> None:
        for slot in self.slots:
            if slot.spec.preload or slot.is_remote:
                try:
                    await self.ensure_loaded(slot, timeout=math.inf)
                except Exception as e:
                    logger.error("loading %r failed: %s", slot.name, slot.error or e)
                    if self.on_preload_error is not None:
                        self.on_preload_error(slot, slot.error or e)
        self.started_up = True

    async def close(self) -> None:
        """Stop every engine (aborting what still runs)."""
        self.closed = True
        for task in self._tasks:
            task.cancel()
        for slot in self.slots:
            if slot.loading is not None:
                slot.loading.cancel()
            if slot.ctx is not None:
                slot.ctx.engine.shutdown()
                slot.ctx = None
            if slot.remote is not None:
                await slot.remote.close()
                slot.remote = None

    def abort_all(self, reason: str) -> None:
        for slot in self.slots:
            if slot.ctx is not None:
                slot.ctx.engine.abort_all(reason)

    @property
    def num_active(self) -> int:
        return sum(s.ctx.engine.num_active for s in self.slots if s.ctx is not None)

    # -- requests ---------------------------------------------------------------------------------------

    async def serve(
        self, name: str | None, remote: Callable[[RemoteModel], Awaitable[T]],
        native: Callable[[ServingContext], Awaitable[T]], keep_alive: float | None = None,
    ) -> T:  # fmt: skip
        """Run a request on the model `name` names, leased while `remote` or `native` runs: the
        one place that decides whether a request goes to an upstream or to a local engine."""
        adapter = self.adapters.get(name) if name is not None else None
        async with self.lease(adapter[0].name if adapter else name, keep_alive) as slot:
            if slot.remote is not None:
                return await remote(slot.remote)
            assert slot.ctx is not None, "a leased local model is loaded"
            if adapter is not None:  # the base model's engine, the adapter's name in responses
                lora = adapter[1]
                return await native(
                    dataclasses.replace(slot.ctx, model_name=lora.lora_name, lora_request=lora)
                )
            return await native(slot.ctx)

    @contextlib.asynccontextmanager
    async def lease(self, name: str | None, keep_alive: float | None = None) -> AsyncIterator[ModelSlot]:
        """The loaded slot for `name`, counted as in use (not evicted) until the block ends; a
        streamed response stays counted through its engine's active requests."""
        slot = self.resolve(name)
        if keep_alive is not None:
            slot.keep_alive = keep_alive
        await self.ensure_loaded(slot)
        slot.leases += 1
        try:
            yield slot
        finally:
            slot.leases -= 1
            slot.last_used = time.monotonic()

    async def ensure_loaded(self, slot: ModelSlot, timeout: float | None = None) -> None:
        """Return once `slot` is loaded; start its load if needed. 503 when it failed to load, or
        when it is still loading after `timeout` (default: the server's model_load_timeout)."""
        if slot.is_remote:
            if slot.remote is None:
                slot.remote = RemoteModel(slot.spec, self._metrics_for(slot, max_model_len=2**17))
                slot.state, slot.loaded_at = LOADED, time.time()
            return
        wait = self.config.model_load_timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        while slot.state != LOADED:
            if self.closed:
                raise APIError(503, "the server is shutting down")
            if (
                slot.state == FAILED
                and time.monotonic() - slot.failed_at < FAILED_RETRY_SECONDS
                and slot.loading is None
            ):
                raise APIError(
                    503, f"loading the model {slot.name!r} failed: {slot.error}", param="model",
                    code="model_load_failed",
                )  # fmt: skip
            if slot.loading is None:
                slot.loading = asyncio.ensure_future(self._load(slot))
            left = None if math.isinf(deadline) else max(0.0, deadline - time.monotonic())
            try:
                await asyncio.wait_for(asyncio.shield(slot.loading), left)
            except TimeoutError:
                raise APIError(
                    503, f"the model {slot.name!r} is still loading; retry shortly", param="model",
                    code="model_loading", headers={"Retry-After": "5"},
                ) from None  # fmt: skip
            except APIError:
                raise
            except Exception:
                continue  # the slot is FAILED now: the loop answers with the reason

    async def load(self, name: str) -> ModelSlot:
        """Load a model now (an operator's request): a failed one is tried again at once."""
        slot = self.resolve(name)
        if slot.state == FAILED:
            slot.failed_at = 0.0
        await self.ensure_loaded(slot, timeout=math.inf)
        slot.last_used = time.monotonic()
        return slot

    async def unload(self, name: str, wait: float | None = None) -> ModelSlot:
        """Unload a model now; requests still running get `wait` seconds (default: the server's
        shutdown_timeout) to finish, then are aborted."""
        slot = self.resolve(name)
        if slot.is_remote:
            raise APIError(400, f"the model {slot.name!r} is remote (engine openai); it has nothing to unload",
                           param="model")  # fmt: skip
        if slot.loading is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(slot.loading)
        deadline = time.monotonic() + (self.config.shutdown_timeout if wait is None else wait)
        while slot.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        async with self._lock:
            await self._unload(slot, "unloaded on request")
        return slot

    # -- loading and unloading --------------------------------------------------------------------------

    def _metrics_for(self, slot: ModelSlot, max_model_len: int, cache_info: dict[str, str] | None = None):
        if self.families is None:
            return None
        if slot.metrics is None or cache_info:
            slot.metrics = PrometheusStatLogger(
                slot.name, max_model_len, cache_info, families=self.families, engine=slot.engine
            )
        return slot.metrics

    async def _load(self, slot: ModelSlot) -> None:
        slot.state = LOADING
        try:
            async with self._lock:
                await self._make_room(slot)
                logger.info("loading %r", slot.name)
                start = time.monotonic()
                args = slot.args
                assert args is not None, "remote models are not loaded"
                engine = await AsyncEngine.launch(
                    lambda: engine_from_args(args),
                    max_queued_requests=self.config.max_queued_requests,
                )
                slot.load_seconds = time.monotonic() - start
        except APIError:
            slot.state = UNLOADED  # no room: not the model's fault
            raise
        except BaseException as e:
            slot.state, slot.error, slot.failed_at = FAILED, e, time.monotonic()
            if self.families is not None:
                self.families.model_loads.labels(slot.name, slot.engine, "failed").inc()
            logger.error("loading %r failed: %s", slot.name, e)
            raise
        finally:
            slot.loading = None
        core = engine.engine
        kv = core.kv_info
        slot.ctx = ServingContext(engine, self.config, slot.name)  # before the metrics: slot.engine reads it
        slot.memory_bytes = int(core.loaded.weight_bytes) + kv.num_blocks * kv.block_size * kv.bytes_per_token
        # the weights and the KV cache live on one device: all in GPU memory, or none of it
        slot.vram_bytes = slot.memory_bytes if core.loaded.device.type != "cpu" else 0
        metrics = self._metrics_for(
            slot, core.max_model_len,
            {
                "block_size": str(kv.block_size),
                "cache_dtype": kv.dtype,
                "num_kv_blocks": str(kv.num_blocks),
                "kv_bytes_per_token": str(kv.bytes_per_token),
                "enable_prefix_caching": str(core.cache_config.enable_prefix_caching),
            },
        )  # fmt: skip
        if metrics is not None:
            engine.add_stat_logger(metrics)
            self.families.model_loads.labels(slot.name, slot.engine, "loaded").inc()  # type: ignore[union-attr]
            self.families.model_load_time.labels(slot.name, slot.engine).observe(slot.load_seconds)  # type: ignore[union-attr]
            self.families.model_loaded.labels(slot.name, slot.engine).set(1)  # type: ignore[union-attr]
        if self.config.stats_log_interval > 0:
            engine.add_stat_logger(LoggingStatLogger(self.config.stats_log_interval))
        if self.tracer_provider is not None:
            engine.tracer = RequestTracer(self.tracer_provider, slot.name)
        engine.on_dead = lambda e: self._engine_died(slot, e)
        slot.state, slot.error = LOADED, None
        slot.loaded_at, slot.last_used = time.time(), time.monotonic()
        slot.num_loads += 1
        async with self._lock:
            await self._fit_after_load(slot)
        logger.info(
            "ready: %r loaded in %.1f s (%.0f MiB with its KV cache)", slot.name, slot.load_seconds,
            slot.memory_bytes / 2**20,
        )  # fmt: skip

    async def _make_room(self, slot: ModelSlot) -> None:
        """Unload idle models, least recently used first, until `slot` fits; wait while the ones
        in the way are busy (bounded by model_load_timeout)."""
        cfg = self.config
        need = slot.estimate_bytes
        if cfg.models_memory is not None and need > cfg.models_memory:
            raise APIError(
                503, f"the model {slot.name!r} needs about {need / 2**20:.0f} MiB (weights and KV cache); "
                f"--models-memory is {cfg.models_memory / 2**20:.0f} MiB", param="model", code="model_too_large",
            )  # fmt: skip
        deadline = time.monotonic() + cfg.model_load_timeout
        while True:
            loaded = [s for s in self.slots if s is not slot and s.state == LOADED and not s.is_remote]
            too_many = cfg.max_loaded_models is not None and len(loaded) + 1 > cfg.max_loaded_models
            used = sum(s.estimate_bytes for s in loaded)
            too_big = cfg.models_memory is not None and used + need > cfg.models_memory
            if not (too_many or too_big):
                return
            idle = sorted((s for s in loaded if not s.busy), key=lambda s: s.last_used)
            if idle:
                why = "--max-loaded-models" if too_many else "--models-memory"
                await self._unload(idle[0], f"evicted (least recently used) to load {slot.name!r} ({why})")
                continue
            if time.monotonic() > deadline:
                raise APIError(
                    503, f"cannot load {slot.name!r}: the loaded models ({', '.join(repr(s.name) for s in loaded)}) "
                    "are all busy", param="model", code="models_busy", headers={"Retry-After": "5"},
                )  # fmt: skip
            await asyncio.sleep(0.05)

    async def _fit_after_load(self, slot: ModelSlot) -> None:
        """The measured size can exceed the estimate a load was admitted on: unload idle models,
        least recently used first, until the budget holds again (or only busy ones are left). Hold
        `_lock`."""
        budget = self.config.models_memory
        if budget is None:
            return
        while True:
            loaded = [s for s in self.slots if s.state == LOADED and not s.is_remote]
            if sum(s.estimate_bytes for s in loaded) <= budget:
                return
            idle = sorted((s for s in loaded if s is not slot and not s.busy), key=lambda s: s.last_used)
            if not idle:
                logger.warning("the loaded models take more than --models-memory; the others are busy")
                return
            await self._unload(
                idle[0], f"evicted (least recently used): {slot.name!r} is larger than estimated"
            )

    async def _unload(self, slot: ModelSlot, why: str) -> None:
        """Stop the slot's engine and free its memory (hold `_lock`)."""
        ctx = slot.ctx
        if ctx is None or slot.state != LOADED:
            return
        slot.state, slot.ctx, slot.keep_alive = UNLOADED, None, None
        await asyncio.to_thread(ctx.engine.shutdown, f"the model {slot.name!r} was unloaded")
        if slot.metrics is not None:
            slot.metrics.set_idle()
        if self.families is not None:
            self.families.model_loaded.labels(slot.name, slot.engine).set(0)
        del ctx
        await asyncio.to_thread(release_memory)
        logger.info("unloaded %r: %s", slot.name, why)

    def _engine_died(self, slot: ModelSlot, e: BaseException) -> None:
        """A loaded model's step loop failed: the slot is failed (its next request after the retry
        delay loads it again); the server decides whether to go on (on_engine_dead)."""
        ctx = slot.ctx
        slot.state, slot.ctx, slot.error, slot.failed_at = FAILED, None, e, time.monotonic()
        if ctx is not None:
            ctx.engine.shutdown()
        if self.families is not None:
            self.families.model_loaded.labels(slot.name, slot.engine).set(0)
        if self.on_engine_dead is not None:
            self.on_engine_dead(slot, e)

    async def _reap(self) -> None:
        """Unload models idle for longer than their keep-alive."""
        default = self.config.keep_alive
        while True:
            await asyncio.sleep(REAP_INTERVAL)
            now = time.monotonic()
            for slot in self.slots:
                if slot.state != LOADED or slot.is_remote:
                    continue
                if slot.busy:
                    slot.last_used = now
                    continue
                keep = slot.keep_alive_seconds(default)
                if now - slot.last_used >= keep:
                    async with self._lock:
                        if slot.state == LOADED and not slot.busy:
                            await self._unload(slot, f"idle for {keep:.0f} s (keep-alive)")

    async def _digests(self) -> None:
        for slot in self.slots:
            if slot.files:
                try:
                    slot.digest = await asyncio.to_thread(files_digest, slot.files)
                except OSError as e:
                    logger.warning("cannot hash the weights of %r: %s", slot.name, e)

    # -- descriptions -----------------------------------------------------------------------------------

    def adapter_card(self, name: str, created: float) -> dict[str, Any]:
        """A LoRA adapter in /v1/models: `parent` is its base model, `root` its folder."""
        slot, request = self.adapters[name]
        return {
            "id": name,
            "object": "model",
            "created": int(created),
            "owned_by": "llmserve",
            "parent": slot.name,
            "root": request.lora_path,
            "state": slot.state,
        }

    def card(self, slot: ModelSlot, created: float) -> dict[str, Any]:
        """The model in /v1/models: OpenAI's fields, then llmserve's."""
        card: dict[str, Any] = {
            "id": slot.name,
            "object": "model",
            "created": int(created),
            "owned_by": "llmserve",
            "state": slot.state,
            "engine": slot.engine,
            "aliases": list(slot.spec.aliases),
            "size": slot.file_bytes,
            "digest": slot.digest,
        }
        if not slot.is_remote:  # weights + KV cache: measured once loaded, estimated before
            card["memory_bytes"] = slot.estimate_bytes
        if slot.ctx is not None:
            card["max_model_len"] = slot.ctx.max_model_len
        if slot.state == FAILED:
            card["error"] = str(slot.error)
        expires = slot.expires_at(self.config.keep_alive)
        if expires is not None:
            card["expires_at"] = int(expires)
        return card


def _adapters(
    slots: list[ModelSlot], by_name: dict[str, ModelSlot]
) -> dict[str, tuple[ModelSlot, LoRARequest]]:
    """Every local model's `lora_modules` by name; a name that is also a model's is refused."""
    adapters: dict[str, tuple[ModelSlot, LoRARequest]] = {}
    for slot in slots:
        config = slot.args.lora_config() if slot.args is not None else None
        for request in module_requests(config) if config is not None else []:
            if request.lora_name in by_name or request.lora_name in adapters:
                raise ValueError(
                    f"LoRA adapter name {request.lora_name!r} is already a model's or an adapter's name"
                )
            adapters[request.lora_name] = (slot, request)
    return adapters
