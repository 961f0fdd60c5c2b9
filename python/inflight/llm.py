"""The LLM API: ``LLM(model).generate(prompts, sampling_params)`` and friends (vLLM/TRT-LLM style)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from inflight.batch_manager import ContextChunkingConfig
from inflight.executor.kv_cache_creator import (
    KvBudget,
    cpu_kv_budget,
    gpu_kv_budget,
    kv_bytes_per_token,
)
from inflight.executor.llm_request import ExecutorRequest, Response
from inflight.executor.model_engine import ModelEngine
from inflight.executor.py_executor import PyExecutor
from inflight.executor.resource_manager import KVCacheResourceManager, ResourceManager, SeqSlotManager
from inflight.executor.sampler import Sampler, SamplingState
from inflight.executor.scheduler import (
    BindCapacityScheduler,
    BindMicroBatchScheduler,
    RequestScheduler,
    SimpleScheduler,
)
from inflight.llm_args import KvCacheConfig, SchedulerConfig, parse_dtype
from inflight.outputs import CompletionOutput, RequestOutput
from inflight.sampling_params import SamplingParams

logger = logging.getLogger("inflight")

PromptType = str | Sequence[int]


def _ensure_logging() -> None:
    """A default handler for the `inflight` logger (start-up budget, preemption warnings), unless the
    application configured logging itself."""
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[inflight] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


class LLM:
    """An inference engine for one model.

    Args:
        model: a Hugging Face model directory (config.json + safetensors), a ``.gguf`` file, or a known
            short name ("smollm2").
        dtype: "auto" (the checkpoint's dtype; float16 becomes bfloat16 on a CPU), "float32",
            "bfloat16", "float16" (or fp32/bf16/fp16, or a torch dtype). For natively quantised weights it
            is the activation dtype.
        quantization: what a GGUF file's 4-bit weights do. None ("auto"): native 4-bit kernels with
            ``dtype="auto"`` on a CPU (fp32 activations), dequantised into an explicit dtype. "gguf":
            always native, ``dtype`` the activation dtype (as vLLM runs GGUF files), e.g.
            ``LLM("smollm2", dtype="bfloat16", quantization="gguf")``. "none": always dequantised.
        kv_cache_config: :class:`KvCacheConfig`.
        scheduler_config: :class:`SchedulerConfig` (capacity and chunking policies).
        max_batch_size: most requests in one forward (default 256).
        max_num_tokens: most tokens in one forward (default 8192).
        max_seq_len: prompt + output limit (default: the model's max_position_embeddings; reduced to
            what the KV pool can hold, with a warning).
        enable_chunked_prefill: split long prompts over several steps.
        disable_overlap_scheduler: None picks the measured-faster default for the device.
        scheduler: a :class:`~inflight.executor.scheduler.RequestScheduler`, or a callable
            ``f(kv_cache_manager=..., max_batch_size=..., max_num_tokens=...)`` returning one.
        seed: seed of the shared sampling generator (requests without their own seed).
        attention_backend: "native" (C++ / CUDA kernels over the paged cache; the default) or
            "torch" (the plain-torch reference).
        device: "cpu", "cuda", ... (default: CUDA when available).
        log_iteration_stats: log one line every N iterations (0: off).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        dtype: str | torch.dtype = "auto",
        kv_cache_config: KvCacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        max_batch_size: int = 256,
        max_num_tokens: int = 8192,
        max_seq_len: int | None = None,
        enable_chunked_prefill: bool = False,
        disable_overlap_scheduler: bool | None = None,
        scheduler: Any = None,
        seed: int = 0,
        attention_backend: str | None = None,
        device: str | torch.device | None = None,
        log_iteration_stats: int = 0,
        quantization: str | None = None,
        **unknown: Any,
    ):
        if unknown:
            raise ValueError(
                f"unknown LLM argument(s): {', '.join(sorted(unknown))} (accepted: dtype, kv_cache_config, "
                "scheduler_config, max_batch_size, max_num_tokens, max_seq_len, enable_chunked_prefill, "
                "disable_overlap_scheduler, scheduler, seed, attention_backend, device, log_iteration_stats, "
                "quantization)"
            )
        _ensure_logging()
        for name, value in (("max_batch_size", max_batch_size), ("max_num_tokens", max_num_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)
                                        or max_seq_len < 2):
            raise ValueError(f"max_seq_len must be None or an integer >= 2, got {max_seq_len!r}")
        kv_cache_config = kv_cache_config if kv_cache_config is not None else KvCacheConfig()
        scheduler_config = scheduler_config if scheduler_config is not None else SchedulerConfig()
        if not isinstance(kv_cache_config, KvCacheConfig):
            raise ValueError(f"kv_cache_config must be a KvCacheConfig, got {type(kv_cache_config).__name__}")
        if not isinstance(scheduler_config, SchedulerConfig):
            raise ValueError(f"scheduler_config must be a SchedulerConfig, got {type(scheduler_config).__name__}")
        if not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        if disable_overlap_scheduler is None:
            disable_overlap_scheduler = self.device.type == "cpu"
        self._lock = threading.Lock()
        self._handles: dict[int, RequestHandle] = {}
        self._ids = itertools.count()
        self._shutdown = False
        self.executor = None

        from inflight.models.auto import load_model

        t0 = time.perf_counter()
        loaded = load_model(model, dtype=parse_dtype(dtype), device=self.device,
                            attention_backend=attention_backend, max_seq_len=max_seq_len,
                            quantization=quantization)
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.dtype = loaded.dtype
        cfg = self.model_config
        model_max = cfg.max_position_embeddings
        if max_seq_len is not None and max_seq_len > model_max:
            raise ValueError(f"max_seq_len must be <= the model's max_position_embeddings={model_max}, "
                             f"got {max_seq_len}")
        max_seq_len = max_seq_len if max_seq_len is not None else model_max
        logger.info("loaded %s (%s, %s, %d layers) in %.1f s", model, cfg.architecture, self.dtype,
                    cfg.num_hidden_layers, time.perf_counter() - t0)

        kv_dtype = parse_dtype(kv_cache_config.dtype, "KvCacheConfig.dtype") or self.dtype
        bpt = kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, kv_dtype)
        budget = self._kv_budget(kv_cache_config, bpt, max_seq_len, max_num_tokens, kv_dtype)
        logger.info("%s", budget.describe())
        if budget.num_tokens < max_seq_len:
            logger.warning("max_seq_len reduced from %d to %d: the KV cache holds only %d tokens",
                           max_seq_len, budget.num_tokens, budget.num_tokens)
            max_seq_len = budget.num_tokens
        self.max_seq_len = max_seq_len
        self.kv_budget = budget
        self.max_num_tokens = max_num_tokens
        self.enable_chunked_prefill = enable_chunked_prefill

        kv_manager = KVCacheResourceManager(
            cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, budget.num_blocks,
            kv_cache_config.tokens_per_block, max_seq_len, kv_dtype, self.device, kv_cache_config.enable_block_reuse)
        self.kv_cache_manager = kv_manager
        resources = ResourceManager({"seq_slot_manager": SeqSlotManager(max_batch_size * 2),
                                     "kv_cache_manager": kv_manager})
        if scheduler is None:
            chunking = (ContextChunkingConfig(scheduler_config.context_chunking_policy,
                                              kv_cache_config.tokens_per_block) if enable_chunked_prefill else None)
            scheduler = SimpleScheduler(
                BindCapacityScheduler(max_batch_size, kv_manager.impl, scheduler_config.capacity_scheduler_policy,
                                      two_steps_lookahead=not disable_overlap_scheduler),
                BindMicroBatchScheduler(max_batch_size, max_num_tokens, chunking),
            )
        elif not isinstance(scheduler, RequestScheduler):
            if not callable(scheduler):
                raise ValueError(f"scheduler must be a RequestScheduler or a factory, got {type(scheduler).__name__}")
            scheduler = scheduler(kv_cache_manager=kv_manager.impl, max_batch_size=max_batch_size,
                                  max_num_tokens=max_num_tokens)
            if not isinstance(scheduler, RequestScheduler):
                raise ValueError("the scheduler factory must return a RequestScheduler")
        self.scheduler = scheduler
        sampler = Sampler(cfg.vocab_size)
        # Requests without a seed of their own draw from torch's default generator.
        torch.manual_seed(seed)
        engine = ModelEngine(self.model, kv_manager, self.device, max_batch_size)
        self.executor = PyExecutor(
            engine, resources, scheduler, sampler, max_seq_len=max_seq_len,
            max_num_active_requests=max_batch_size * 2, disable_overlap_scheduler=disable_overlap_scheduler,
            response_callback=self._on_response, log_stats_every=log_iteration_stats)
        self.disable_overlap_scheduler = disable_overlap_scheduler

    # ------------------------------------------------------------------ set-up helpers
    def _kv_budget(self, kv_config: KvCacheConfig, bpt: int, max_seq_len: int, max_num_tokens: int,
                   kv_dtype: torch.dtype) -> KvBudget:
        if self.device.type != "cuda":
            return cpu_kv_budget(kv_config, bpt, max_seq_len)
        # Two passes (TensorRT-LLM): a warm-up forward of max_num_tokens dummy tokens over a tiny
        # pool measures the activation peak, then the pool takes a fraction of what is left.
        warm_tokens = min(max_num_tokens, max_seq_len)
        tpb = kv_config.tokens_per_block
        tiny = KVCacheResourceManager(
            self.model_config.num_hidden_layers, self.model_config.num_key_value_heads, self.model_config.head_dim,
            -(-warm_tokens // tpb), tpb, warm_tokens, kv_dtype, self.device, False)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._warmup(tiny, warm_tokens)
        tiny.shutdown()
        return gpu_kv_budget(kv_config, bpt, max_seq_len, self.device)

    def _warmup(self, kv: KVCacheResourceManager, num_tokens: int) -> None:
        from inflight.batch_manager import LlmRequest
        from inflight.executor.resource_manager import ScheduledBatch

        req = LlmRequest(0, 1, [0] * num_tokens)
        batch = ScheduledBatch([req], [])
        kv.prepare_resources(batch)
        engine = ModelEngine(self.model, kv, self.device, 1)
        engine.forward(engine.prepare(batch))
        kv.free_resources(req, store_for_reuse=False)
        torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ requests
    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer files: pass prompts as lists of token ids")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a str or a list of int token ids, got {type(prompt).__name__}")

    def _validate(self, ids: list[int], params: SamplingParams) -> int:
        """Checks that the request can ever run; returns its max_new_tokens."""
        vocab = self.model_config.vocab_size
        if not ids:
            raise ValueError("prompt must not be empty")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of the vocabulary [0, {vocab})")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids must be in [0, {vocab}) (the vocabulary), got {bad_stop!r}")
        n = len(ids)
        if n >= self.max_seq_len:
            raise ValueError(f"prompt length {n} must be < max_seq_len={self.max_seq_len} (room for one output token)")
        if params.max_tokens is not None and n + params.max_tokens > self.max_seq_len:
            raise ValueError(f"prompt length {n} + max_tokens {params.max_tokens} exceeds max_seq_len="
                             f"{self.max_seq_len}")
        if not self.enable_chunked_prefill and n > self.max_num_tokens:
            raise ValueError(f"prompt length {n} exceeds max_num_tokens={self.max_num_tokens}; raise it or "
                             "set enable_chunked_prefill=True")
        return params.max_tokens if params.max_tokens is not None else self.max_seq_len - n

    def generate_async(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       streaming: bool = False, priority: float = 0.5) -> RequestHandle:
        """Submits one prompt; returns a :class:`RequestHandle` (future, awaitable, async-iterable)."""
        return self._submit(prompt, sampling_params, streaming, priority)

    def _submit(self, prompt, params, streaming, priority=0.5, prepared=None) -> RequestHandle:
        if self._shutdown:
            raise RuntimeError("LLM is shut down")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text, ids = prepared if prepared is not None else self._tokenize(prompt)
        max_new = self._validate(ids, params)
        cfg = self.model_config
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 or params.seed is None else params.replace(seed=params.seed + i)
            state = SamplingState.create(child_params, cfg.vocab_size, ids, cfg.eos_token_ids, device=self.device)
            rid = next(self._ids)
            # Stop strings are matched on text here, so their requests report every token.
            report_each_token = streaming or bool(params.stop)
            children.append(ExecutorRequest(rid, ids, max_new, child_params, state, report_each_token, priority))
        handle = RequestHandle(self, children, text, ids, params, streaming, self.tokenizer)
        with self._lock:
            for c in children:
                self._handles[c.request_id] = handle
        try:
            for c in children:
                self.executor.enqueue_request(c)
        except Exception:
            with self._lock:
                for c in children:
                    self._handles.pop(c.request_id, None)
            raise
        return handle

    def _on_response(self, resp: Response) -> None:
        """Executor thread: routes a response to its handle."""
        with self._lock:
            handle = self._handles.get(resp.request_id)
            if resp.finished:
                self._handles.pop(resp.request_id, None)
        if handle is not None:
            handle._on_response(resp)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> RequestOutput | list[RequestOutput]:
        """One prompt (a str or a list of token ids) in -> one RequestOutput; a list in -> a list."""
        if not isinstance(prompts, (str, list, tuple)):
            raise ValueError("prompts must be a str, a list of token ids, or a list of those, got "  # noqa: TRY004
                             f"{type(prompts).__name__}")
        single = isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and len(prompts) > 0
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts))
        plist = [prompts] if single else list(prompts)
        if not single and isinstance(prompts, (list, tuple)) and len(prompts) == 0:
            return []
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(plist)
        elif isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            if len(params) != len(plist):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(plist)} prompts")
        else:
            raise ValueError("sampling_params must be a SamplingParams or a list of them, got "
                             f"{type(sampling_params).__name__}")
        for sp in params:
            if sp is not None and not isinstance(sp, SamplingParams):
                raise ValueError(
                    f"sampling_params must be SamplingParams, got an item of type {type(sp).__name__}")
        # Validate everything before submitting anything: a bad prompt fails the call, not half of it.
        prepared = [self._tokenize(p) for p in plist]
        for (_, ids), sp in zip(prepared, params):
            self._validate(ids, sp if sp is not None else SamplingParams())
        handles = [self._submit(p, sp, False, prepared=pre) for p, sp, pre in zip(plist, params, prepared)]
        outputs = self._wait_all(handles, use_tqdm)
        return outputs[0] if single else outputs

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> RequestOutput | list[RequestOutput]:
        """Generates replies to one conversation (a list of {"role", "content"} messages) or to a list
        of conversations, through the model's chat template."""
        single = len(messages) > 0 and isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        outs = self.generate(prompts, sampling_params, use_tqdm)
        return outs[0] if single else outs

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The token ids of a conversation rendered by the model's chat template."""
        if self.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer, so it has no chat template")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model's tokenizer has no chat template")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)
        # The template already holds the special tokens; do not add a BOS on top.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _wait_all(self, handles: list[RequestHandle], use_tqdm: bool) -> list[RequestOutput]:
        if not use_tqdm:
            return [h.result() for h in handles]
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        n_in = n_out = 0
        pending = set(range(len(handles)))
        with tqdm(total=len(handles), desc="Processed prompts", dynamic_ncols=True) as bar:
            while pending:
                handles[min(pending)].wait(timeout=0.1)
                finished_now = [i for i in pending if handles[i].done]
                for i in finished_now:
                    pending.discard(i)
                    out = handles[i].result()
                    n_in += len(out.prompt_token_ids)
                    n_out += sum(len(c.token_ids) for c in out.outputs)
                if finished_now:
                    dt = max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix_str(f"input {n_in / dt:.1f} tok/s, output {n_out / dt:.1f} tok/s", refresh=False)
                    bar.update(len(finished_now))
        return [h.result() for h in handles]

    # ------------------------------------------------------------------ stats and lifetime
    def get_stats(self) -> list[dict]:
        """One dict per recent iteration, oldest first (see api.md for the keys)."""
        if self.executor is None:
            return []
        return self.executor.get_stats()

    def shutdown(self) -> None:
        """Finishes running requests, stops the executor, releases the KV pool and the weights."""
        if self._shutdown:
            return
        self._shutdown = True
        if self.executor is not None:
            self.executor.shutdown()
            self.executor.model_engine.model = None
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        try:
            if not self._shutdown and self.executor is not None:
                self.shutdown()
        except Exception:  # noqa: BLE001  (interpreter teardown)
            pass


class RequestHandle:
    """A submitted prompt: a future (``result()``), awaitable, async-iterable when streaming, and
    abortable. It binds to the event loop that first awaits or iterates it."""

    def __init__(self, llm: LLM, children: list[ExecutorRequest], prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, streaming: bool, tokenizer):
        self._llm = llm
        self._ids = [c.request_id for c in children]
        self.request_id = self._ids[0]
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.streaming = streaming
        self._seqs = [_SequenceState(i, params, tokenizer, streaming) for i in range(len(children))]
        self._by_id = {rid: seq for rid, seq in zip(self._ids, self._seqs)}
        self._cond = threading.Condition()
        self._stream: list[RequestOutput] = []
        self._final: RequestOutput | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._metrics: dict[str, float] = {}

    # -- executor thread
    def _on_response(self, resp: Response) -> None:
        with self._cond:
            seq = self._by_id[resp.request_id]
            if seq.finished:
                return  # e.g. the cancellation that follows a stop string found here
            stopped_here = seq.update(resp)
            if stopped_here:
                self._llm.executor.cancel_request(resp.request_id)
            if resp.finished and resp.metrics:
                self._metrics = resp.metrics
            done = all(s.finished for s in self._seqs)
            out = self._snapshot(done, diff=True)
            if self.streaming:
                self._stream.append(out)
            if done:
                self._final = self._snapshot(True, diff=False)
            self._cond.notify_all()
            loop, event = self._loop, self._event
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop was closed
                pass

    def _snapshot(self, finished: bool, diff: bool) -> RequestOutput:
        outs = [s.output(diff) for s in self._seqs]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, finished, dict(self._metrics))

    # -- synchronous use
    @property
    def done(self) -> bool:
        return self._final is not None

    def wait(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._final is not None, timeout)

    def result(self, timeout: float | None = None) -> RequestOutput:
        if not self.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        return self._final

    def abort(self) -> None:
        """Cancels the request; a no-op when it already finished."""
        if self._final is not None:
            return
        for rid, seq in zip(self._ids, self._seqs):
            if not seq.finished:
                self._llm.executor.cancel_request(rid)

    # -- asyncio
    def _bind(self) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._loop is None:
                self._loop, self._event = loop, asyncio.Event()
            elif self._loop is not loop:
                # A finished request, or one whose loop is gone (asyncio.run returned), will never
                # signal the old loop again: the new one may take it over.
                if self._final is None and not self._loop.is_closed():
                    raise RuntimeError("this request handle is bound to another event loop")
                self._loop, self._event = loop, asyncio.Event()
            return self._event

    def __await__(self):
        return self._aresult().__await__()

    async def _aresult(self) -> RequestOutput:
        event = self._bind()
        while True:
            with self._cond:
                if self._final is not None:
                    return self._final
                event.clear()
            await event.wait()

    def __aiter__(self):
        if not self.streaming:
            raise TypeError("only a streaming request (generate_async(..., streaming=True)) can be iterated")
        return self._aiter()

    async def _aiter(self):
        event = self._bind()
        i = 0
        while True:
            with self._cond:
                items = self._stream[i:]
                i += len(items)
                finished = self._final is not None and i >= len(self._stream)
                if not items and not finished:
                    event.clear()
            for item in items:
                yield item
            if finished:
                return
            if not items:
                await event.wait()


class _SequenceState:
    """One output sequence of a request: tokens, text, stop strings, finish."""

    def __init__(self, index: int, params: SamplingParams, tokenizer, streaming: bool):
        self.index = index
        self.params = params
        self.tokenizer = tokenizer if params.detokenize else None
        self.streaming = streaming
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = None
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self._sent_tokens = 0
        self._sent_text = 0
        self._max_stop = max((len(s) for s in params.stop), default=0)
        # Streamed text is only what later tokens cannot change: the last max_stop - 1 characters
        # may yet start a stop string that is cut off (unless it is kept in the output).
        self._hold = self._max_stop - 1 if self._max_stop and not params.include_stop_str_in_output else 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, resp: Response) -> bool:
        """Takes a response; True when a stop string ended the sequence here (while the executor
        request is still running, so the caller cancels it)."""
        self.token_ids.extend(resp.new_token_ids)
        if self.logprobs is not None and resp.new_logprobs:
            self.logprobs.extend(resp.new_logprobs)
        if resp.cumulative_logprob is not None:
            self.cumulative_logprob = resp.cumulative_logprob
        stop_str = None
        if self.tokenizer is not None and (self.streaming or self.params.stop or resp.finished):
            stop_str = self._detokenize(resp)
        if stop_str is not None:
            self.finish_reason, self.stop_reason = "stop", stop_str
            return not resp.finished
        if resp.finished:
            self.finish_reason, self.stop_reason, self.error = resp.finish_reason, resp.stop_reason, resp.error
        return False

    def _detokenize(self, resp: Response) -> str | None:
        """Updates the text; returns the stop string that ends it, if one appeared."""
        ids = self.token_ids
        if resp.finished and resp.finish_reason == "stop" and ids:
            ids = ids[:-1]  # the EOS / stop token is in token_ids, not in the text
        prev_len = len(self.text)
        self.text = self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)
        if not self.params.stop:
            return None
        # A stop string may end in this step's text yet start in earlier text (split across tokens).
        start = max(0, prev_len - self._max_stop + 1)
        hits = [(i, s) for s in self.params.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return None
        i, s = min(hits)
        self.text = self.text[: i + len(s)] if self.params.include_stop_str_in_output else self.text[:i]
        return s

    def _stable_text(self) -> str:
        """The text so far that later tokens cannot take back: all of it once finished; before that,
        without the characters that may start a stop string (``_hold``) and without a trailing
        U+FFFD (an incomplete UTF-8 sequence that the next token may complete)."""
        text = self.text
        if self.finished:
            return text
        if self._hold:
            text = text[: max(len(text) - self._hold, 0)]
        return text.rstrip("\ufffd")

    def output(self, diff: bool) -> CompletionOutput:
        text = self._stable_text()
        out = CompletionOutput(self.index, text, list(self.token_ids), self.cumulative_logprob,
                               list(self.logprobs) if self.logprobs is not None else None, self.finish_reason,
                               self.stop_reason, self.error)
        if diff:
            out.text_diff = text[self._sent_text:]
            out.token_ids_diff = self.token_ids[self._sent_tokens:]
            self._sent_text, self._sent_tokens = len(text), len(self.token_ids)
        return out
