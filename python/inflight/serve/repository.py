"""Triton's model repository: ``inflight serve --model-repository DIR`` serves every model of DIR.

Each subdirectory of DIR is a model named after it, configured by Triton's ``config.pbtxt`` (parsed
with protobuf's text format into the ``ModelConfig`` message that tritonclient ships, so the
tensorrtllm_backend's configs read as written) or by ``config.json`` (the same message in JSON, with
``parameters`` also accepted as plain ``{"key": "value"}``). What the model runs is its
``parameters`` ``model`` (or the backend's ``gpt_model_path``): a Hugging Face directory, a .gguf
file or a known name like ``smollm2`` (a relative path is taken inside the model's directory), else
the model's version directory ``1/`` (a Hugging Face directory, or the one .gguf file in it).

The engine parameters of the TensorRT-LLM backend map to :class:`~inflight.llm_args.LlmArgs`
(:data:`ENGINE_PARAMETERS`): the KV fraction, the paged cache's token cap, block reuse, chunked
context, the batch scheduler policy, beam width and the token budget; the top-level ``max_batch_size``
is the engine's. Parameters of the backend that do not apply here are logged, once, as ignored; an
unfilled template value (``${...}``) counts as unset, as the backend treats it. ``dynamic_batching``
puts Triton's dynamic batcher in front of the engine (:mod:`inflight.serve.batcher`).

Model control (Triton's): ``none`` loads every model at start-up and refuses load and unload;
``explicit`` loads the ``--load-model`` ones (``*``: all) and then what ``POST
/v2/repository/models/{m}/load`` asks for (also over gRPC). A load builds the engine on a worker
thread while the other models serve; a failed load leaves the model UNAVAILABLE with the reason (a
model that should have loaded at start-up keeps the server not ready). A reload (load of a loaded
model, optionally with a new ``config``) builds the new engine first and swaps it in; on failure the
old one keeps serving. Unload stops new requests at once (UNLOADING), lets the requests in flight
finish, then shuts the engine down and drops it, freeing its memory (UNAVAILABLE, "unloaded").

KV memory is split explicitly: each engine takes ``1/N`` of the machine's KV budget for the N models
of the repository (``KvCacheConfig.memory_share``), whether or not the others are loaded, so that
loading one never shrinks another; the start-up log says so, and each engine logs its own pool.
"""

from __future__ import annotations

import asyncio
import gc
import glob
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from inflight.batch_manager import CapacitySchedulerPolicy
from inflight.llm_args import LlmArgs
from inflight.serve.batcher import BatchingPolicy
from inflight.serve.metrics import TritonStats
from inflight.serve.protocol import APIError
from inflight.serve.state import MODEL_VERSION, ModelSet, ServerState

logger = logging.getLogger("inflight.serve")

MODEL_KEYS = ("model", "gpt_model_path")


def _bool(key: str, value: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"parameter '{key}' must be true or false, got {value!r}")


def _policy(key: str, value: str) -> CapacitySchedulerPolicy:
    names = {
        "max_utilization": "MAX_UTILIZATION",
        "guaranteed_no_evict": "GUARANTEED_NO_EVICT",
        "static_batch": "STATIC_BATCH",
    }
    name = names.get(value.strip().lower())
    if name is None:
        raise ValueError(f"parameter '{key}' must be one of {', '.join(names)}, got {value!r}")
    return CapacitySchedulerPolicy[name]


def _number(kind):
    def parse(key: str, value: str):
        try:
            return kind(value)
        except ValueError:
            raise ValueError(
                f"parameter '{key}' must be {'an integer' if kind is int else 'a number'}, got {value!r}"
            ) from None

    return parse


# parameter key -> (where: "llm" | "kv" | "scheduler", LlmArgs field, parse). The TensorRT-LLM
# backend's names first, then inflight's own for what the backend sets when building an engine.
ENGINE_PARAMETERS: dict[str, tuple[str, str, Any]] = {
    "kv_cache_free_gpu_mem_fraction": ("kv", "free_memory_fraction", _number(float)),
    "max_tokens_in_paged_kv_cache": ("kv", "max_tokens", _number(int)),
    "enable_kv_cache_reuse": ("kv", "enable_block_reuse", _bool),
    "enable_chunked_context": ("llm", "enable_chunked_prefill", _bool),
    "batch_scheduler_policy": ("scheduler", "capacity_scheduler_policy", _policy),
    "max_beam_width": ("llm", "max_beam_width", _number(int)),
    "max_num_tokens": ("llm", "max_num_tokens", _number(int)),
    "max_seq_len": ("llm", "max_seq_len", _number(int)),
    "dtype": ("llm", "dtype", lambda k, v: v),
    "quantization": ("llm", "quantization", lambda k, v: v),
    "activation_quantization": ("llm", "activation_quantization", lambda k, v: v),
    "kv_cache_dtype": ("kv", "dtype", lambda k, v: v),
    "tokens_per_block": ("kv", "tokens_per_block", _number(int)),
}


@dataclass
class ModelSpec:
    """A model directory's configuration, resolved: what to run and how."""

    name: str
    directory: str
    model: str
    config: Any  # model_config_pb2.ModelConfig
    llm: dict[str, Any]
    kv: dict[str, Any]
    scheduler: dict[str, Any]
    batching: BatchingPolicy | None
    ignored: list[str]

    def engine_args(self, base: LlmArgs, memory_share: float) -> LlmArgs:
        kv = base.kv_cache_config.replace(**self.kv, memory_share=memory_share)
        scheduler = base.scheduler_config.replace(**self.scheduler)
        return base.replace(model=self.model, kv_cache_config=kv, scheduler_config=scheduler, **self.llm)


def _parameters_shorthand(obj: dict) -> dict:
    params = obj.get("parameters")
    if isinstance(params, dict):
        obj = dict(obj)
        obj["parameters"] = {
            k: v
            if isinstance(v, dict)
            else {"string_value": str(v).lower() if isinstance(v, bool) else str(v)}
            for k, v in params.items()
        }
    return obj


def parse_config(directory: str, override: str | None = None):
    """The directory's ModelConfig (``override``: the JSON of a load request wins); a ValueError
    names the file and the problem."""
    config = model_config_pb2.ModelConfig()
    try:
        if override is not None:
            json_format.ParseDict(_parameters_shorthand(json.loads(override)), config)
            return config, "the load request's config"
        pbtxt = os.path.join(directory, "config.pbtxt")
        if os.path.isfile(pbtxt):
            with open(pbtxt, encoding="utf-8") as f:
                text_format.Parse(f.read(), config)
            return config, pbtxt
        cjson = os.path.join(directory, "config.json")
        if os.path.isfile(cjson):
            with open(cjson, encoding="utf-8") as f:
                json_format.ParseDict(_parameters_shorthand(json.load(f)), config)
            return config, cjson
    except (
        text_format.ParseError,
        json_format.ParseError,
        json.JSONDecodeError,
        TypeError,
        AttributeError,
    ) as exc:
        where = "the load request's config" if override is not None else directory
        raise ValueError(f"invalid model configuration in {where}: {exc}") from None
    raise ValueError(f"no config.pbtxt or config.json in {directory}")


def _model_source(name: str, directory: str, params: dict[str, str]) -> str:
    for key in MODEL_KEYS:
        value = params.get(key)
        if value:
            inside = os.path.join(directory, value)
            return inside if not os.path.isabs(value) and os.path.exists(inside) else value
    version_dir = os.path.join(directory, MODEL_VERSION)
    if os.path.isdir(version_dir):
        if os.path.isfile(os.path.join(version_dir, "config.json")):
            return version_dir
        ggufs = sorted(glob.glob(os.path.join(version_dir, "*.gguf")))
        if len(ggufs) == 1:
            return ggufs[0]
    raise ValueError(
        f"model '{name}' names nothing to run: set the parameter 'model' (or 'gpt_model_path') in its config, "
        f"or put a Hugging Face directory or one .gguf file in {version_dir}"
    )


def read_spec(name: str, directory: str, override: str | None = None) -> ModelSpec:
    """The model of ``directory`` (a ValueError names what is wrong)."""
    config, where = parse_config(directory, override)
    if config.name and config.name != name:
        raise ValueError(f"{where} names the model '{config.name}', but its directory is '{name}'")
    params: dict[str, str] = {}
    for key, p in config.parameters.items():
        value = p.string_value
        if value.startswith("${") and value.endswith("}"):  # an unfilled template: unset
            continue
        params[key] = value
    groups: dict[str, dict[str, Any]] = {"llm": {}, "kv": {}, "scheduler": {}}
    ignored = []
    for key, value in sorted(params.items()):
        if key in MODEL_KEYS:
            continue
        rule = ENGINE_PARAMETERS.get(key)
        if rule is None:
            ignored.append(key)
            continue
        where_to, field, parse = rule
        groups[where_to][field] = parse(key, value)
    if config.max_batch_size > 0:
        groups["llm"]["max_batch_size"] = int(config.max_batch_size)
    batching = (
        BatchingPolicy.from_proto(config.dynamic_batching) if config.HasField("dynamic_batching") else None
    )
    return ModelSpec(
        name,
        directory,
        _model_source(name, directory, params),
        config,
        groups["llm"],
        groups["kv"],
        groups["scheduler"],
        batching,
        ignored,
    )


class Entry:
    """One model of the repository: its state, the reason when it is not READY, its serving engine."""

    def __init__(self, name: str, directory: str):
        self.name = name
        self.directory = directory
        self.state = "UNAVAILABLE"
        self.reason = "unloaded"
        self.server: ServerState | None = None
        self.triton = TritonStats()  # kept across reloads, as Triton keeps a model's statistics
        self.startup_failed = False  # it should have loaded at start-up and has not loaded since
        self.lock: asyncio.Lock | None = None


class ModelRepository(ModelSet):
    """The models of a repository directory (see the module doc). ``base`` holds the engine options of
    the command line, which each model's configuration overrides."""

    def __init__(
        self,
        root: str,
        base: LlmArgs,
        *,
        control_mode: str = "none",
        version: str,
        max_queue_size: int = 1024,
        stall_timeout: float = 120.0,
    ):
        if control_mode not in ("none", "explicit"):
            raise ValueError(f"--model-control-mode must be none or explicit, got {control_mode!r}")
        if not os.path.isdir(root):
            raise ValueError(f"--model-repository {root!r} is not a directory")
        super().__init__(version, max_queue_size, stall_timeout)
        self.root = root
        self.base = base
        self.control_mode = control_mode
        self.entries: dict[str, Entry] = {}
        self._retiring: set[ServerState] = set()
        self._tasks: set[asyncio.Task] = set()  # engines shutting down after their last requests
        self._guard = threading.Lock()  # entries and states change on the loop and in start-up
        self._scan()
        if not self.entries:
            raise ValueError(f"the model repository {root!r} has no model directories")
        self.memory_share = 1.0 / len(self.entries)
        logger.info(
            "model repository %s: %d models (%s); KV memory split equally: each engine takes 1/%d of the "
            "machine's KV budget (memory_share=%.3g), loaded or not, so loading one never shrinks another",
            root,
            len(self.entries),
            ", ".join(self.entries),
            len(self.entries),
            self.memory_share,
        )

    def _scan(self) -> None:
        for name in sorted(os.listdir(self.root)):
            path = os.path.join(self.root, name)
            if name.startswith(".") or not os.path.isdir(path) or name in self.entries:
                continue
            self.entries[name] = Entry(name, path)

    # -- ModelSet
    def serving(self) -> list[ServerState]:
        with self._guard:
            return [e.server for e in self.entries.values() if e.server is not None and e.state == "READY"]

    def running(self) -> list[ServerState]:
        with self._guard:
            live = [e.server for e in self.entries.values() if e.server is not None]
            return live + list(self._retiring)

    def missing(self, name: str) -> str | None:
        entry = self.entries.get(name)
        if entry is None:
            return "not found"
        if entry.state == "READY":
            return None
        return f"{entry.state}: {entry.reason}" if entry.reason else entry.state

    def failed(self) -> list[str]:
        return [e.name for e in self.entries.values() if e.startup_failed]

    def index(self) -> list[dict]:
        self._scan()
        out = []
        for e in self.entries.values():
            item = {"name": e.name, "state": e.state}
            if e.server is not None or e.state != "UNAVAILABLE":
                item["version"] = MODEL_VERSION
            if e.reason:
                item["reason"] = e.reason
            out.append(item)
        return out

    # -- building engines
    def _build(self, entry: Entry, override: str | None) -> ServerState:
        """Reads the model's config and builds its engine (blocking: a worker thread or start-up)."""
        from inflight.llm import LLM

        spec = read_spec(entry.name, entry.directory, override)
        if spec.ignored:
            logger.info(
                "model '%s': parameters not used by inflight (ignored): %s",
                entry.name,
                ", ".join(spec.ignored),
            )
        args = spec.engine_args(self.base, self.memory_share)
        logger.info(
            "model '%s': loading %s (max_batch_size %d, %s%s)",
            entry.name,
            spec.model,
            args.max_batch_size,
            "dynamic batching" if spec.batching is not None else "no dynamic batching",
            "".join(f", {k}={v}" for k, v in {**spec.llm, **spec.kv, **spec.scheduler}.items()),
        )
        llm = LLM(**args.to_kwargs())
        try:
            state = ServerState(
                llm,
                entry.name,
                self.max_queue_size,
                version=self.version,
                stall_timeout=self.stall_timeout,
                metrics=self.metrics.for_model(entry.name),
                triton=entry.triton,
                batching=spec.batching,
            )
        except BaseException:
            llm.shutdown()
            raise
        state.draining = self.draining
        return state

    def load_at_startup(self, names: list[str]) -> None:
        """Start-up loads, one after the other, before the server listens (``*``: every model; in
        ``none`` mode every model whatever ``names`` says). A failure is logged and leaves the model
        UNAVAILABLE with its reason (the server then is not ready)."""
        wanted = list(self.entries) if self.control_mode == "none" or "*" in names else names
        for name in wanted:
            entry = self.entries.get(name)
            if entry is None:
                raise ValueError(
                    f"--load-model {name!r}: no such model in {self.root} (it has {', '.join(self.entries)})"
                )
            entry.state, entry.reason = "LOADING", ""
            try:
                state = self._build(entry, None)
            except Exception as exc:  # noqa: BLE001  (one model's failure leaves the others serving)
                entry.state, entry.reason = "UNAVAILABLE", f"failed to load: {_describe(exc)}"
                entry.startup_failed = True
                logger.error("model '%s' %s", name, entry.reason)
                continue
            with self._guard:
                entry.server, entry.state = state, "READY"
            logger.info("model '%s' READY", name)

    # -- model control
    def _control(self, name: str, what: str) -> Entry:
        if self.control_mode != "explicit":
            raise APIError(
                400,
                f"explicit model {what} is not allowed: the server runs with --model-control-mode {self.control_mode}",
            )
        self._scan()
        entry = self.entries.get(name)
        if entry is None:
            raise APIError(400, f"failed to {what} '{name}': no such model in the repository {self.root}")
        if entry.lock is None:
            entry.lock = asyncio.Lock()
        return entry

    async def load(self, name: str, config: str | None = None) -> None:
        entry = self._control(name, "load")
        async with entry.lock:
            old = entry.server
            if old is None:
                entry.state, entry.reason = "LOADING", ""
            try:
                state = await asyncio.to_thread(self._build, entry, config)
            except Exception as exc:  # noqa: BLE001
                reason = f"failed to load: {_describe(exc)}"
                if old is None:
                    entry.state, entry.reason = "UNAVAILABLE", reason
                    logger.error("model '%s' %s", name, reason)
                else:
                    logger.error("model '%s' reload %s; the loaded version keeps serving", name, reason)
                raise APIError(400, f"failed to load '{name}': {_describe(exc)}") from None
            with self._guard:
                entry.server, entry.state, entry.reason = state, "READY", ""
                entry.startup_failed = False
                if old is not None:
                    self._retire(old, "replaced by a reload")
            logger.info("model '%s' READY%s", name, " (reloaded)" if old is not None else "")

    async def unload(self, name: str) -> None:
        entry = self._control(name, "unload")
        async with entry.lock:
            entry.startup_failed = False
            old = entry.server
            if old is None:
                return
            with self._guard:
                entry.server = None
                entry.state = "UNLOADING"
                entry.reason = f"unloading: {old.in_flight} request(s) in flight finish first"
                self._retire(old, "being unloaded", entry)
            logger.info("model '%s' UNLOADING (%d request(s) in flight)", name, old.in_flight)

    def _retire(self, state: ServerState, why: str, entry: Entry | None = None) -> None:
        """Refuses new requests to ``state`` now; shuts its engine down once its requests finished."""
        state.retiring = why
        self._retiring.add(state)
        task = asyncio.ensure_future(self._finish(state, entry))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _finish(self, state: ServerState, entry: Entry | None) -> None:
        while state.in_flight > 0:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(state.llm.shutdown)
        with self._guard:
            self._retiring.discard(state)
            if entry is not None and entry.server is None and entry.state == "UNLOADING":
                entry.state, entry.reason = "UNAVAILABLE", "unloaded"
        state.llm = None  # the engine's memory goes with the last reference
        gc.collect()
        logger.info("model '%s': engine shut down and freed (%s)", state.model_name, state.retiring)

    def close(self) -> None:
        """Shuts every engine down (the server stops)."""
        for state in self.running():
            if state.llm is not None:
                state.llm.shutdown()


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return text if isinstance(exc, ValueError) and text else f"{type(exc).__name__}: {text}"
