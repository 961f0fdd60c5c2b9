"""The LLM API: ``LLM(model).generate(prompts, sampling_params)`` and friends (vLLM/TRT-LLM style).

``LLM`` validates its arguments into an :class:`~inflight.llm_args.LlmArgs`, has the executor factory
(:func:`~inflight.executor.py_executor_creator.create_py_executor`) build and start the engine, and
turns prompts into executor requests whose responses reach a :class:`~inflight.request_handle.RequestHandle`.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from inflight.executor.beam_search import BeamSearch
from inflight.executor.llm_request import ExecutorRequest, Response
from inflight.executor.py_executor_creator import create_py_executor, follower_rank, run_follower_rank
from inflight.executor.sampler import SamplingState
from inflight.llm_args import LlmArgs
from inflight.outputs import BeamSearchOutput, RequestOutput
from inflight.request_handle import RequestHandle
from inflight.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger("inflight")


class RequestError(ValueError):
    """A request the engine refuses. ``param`` names the request field at fault (``prompt``,
    ``messages``, ``stop_token_ids``, ``n``, ``logprobs``), so that a server can report it without
    reading the message."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


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

    ``LLM(model, **kwargs)``: ``model`` is a Hugging Face model directory (config.json + safetensors), a
    ``.gguf`` file, or a known short name ("smollm2"); the keyword arguments are the fields of
    :class:`~inflight.llm_args.LlmArgs` (``dtype``, ``quantization``, ``kv_cache_config``,
    ``scheduler_config``, ``max_batch_size``, ``max_num_tokens``, ``max_seq_len``,
    ``enable_chunked_prefill``, ``disable_overlap_scheduler``, ``scheduler``, ``seed``,
    ``attention_backend``, ``device``, ``log_iteration_stats``), each documented there. An unknown
    keyword is a ValueError naming it.

    After construction: ``args`` (the validated arguments), ``model_config``, ``tokenizer`` (None for a
    directory without tokenizer files), ``device``, ``dtype`` (the activation dtype), ``max_seq_len``
    (reduced to what the KV pool holds, with a warning), ``kv_budget``, ``executor``.
    """

    def __init__(self, model: str | os.PathLike, **kwargs: Any):
        self.args = LlmArgs.from_kwargs(model, **kwargs)
        _ensure_logging()
        self._lock = threading.Lock()
        self._handles: dict[int, RequestHandle] = {}
        self._ids = itertools.count()
        self._shutdown = False
        self.executor = None
        # Under torchrun every rank runs the script: a follower rank serves its shard here until rank 0
        # shuts down, then returns (its LLM takes no requests).
        self.rank = follower_rank(self.args)
        if self.rank != 0:
            self.parallel = f"tp={self.args.tensor_parallel_size} pp={self.args.pipeline_parallel_size}"
            self.model_config = self.tokenizer = self.kv_budget = None
            self.device, self.dtype, self.max_seq_len = torch.device("cpu"), None, 0
            self.follower_exit_code = run_follower_rank(self.args, self.rank)
            self._shutdown = True
            return
        engine = create_py_executor(self.args, self._on_responses)
        self.executor = engine.executor
        self.model_config = engine.model_config
        self.tokenizer = engine.tokenizer
        self.device = engine.device
        self.dtype = engine.dtype
        self.max_seq_len = engine.max_seq_len
        self.kv_budget = engine.kv_budget
        self.parallel = engine.parallel

    @property
    def is_driver(self) -> bool:
        """True on rank 0, the process that takes requests (the only one without parallelism)."""
        return self.rank == 0

    def _require_driver(self) -> None:
        if self.rank != 0:
            raise RuntimeError(
                f"this process was rank {self.rank} of a parallel engine, a follower (it served its shard "
                "until rank 0 shut down): only rank 0 takes requests"
            )

    # ------------------------------------------------------------------ requests
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of a text prompt (as ``generate`` tokenizes it: with the tokenizer's special
        tokens, e.g. a BOS, unless ``add_special_tokens`` is False)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer files: pass prompts as lists of token ids")
        self._check_text_size("prompt", [text])
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    @property
    def max_prompt_bytes(self) -> int:
        """The most UTF-8 bytes of a text prompt (``LlmArgs.max_prompt_bytes``; 16 x max_seq_len)."""
        limit = self.args.max_prompt_bytes
        return limit if limit is not None else 16 * self.max_seq_len

    def _check_text_size(self, field: str, texts: list[str]) -> None:
        """Bounds the tokenizer's work before it starts: valid Unicode, at most max_prompt_bytes."""
        limit = self.max_prompt_bytes
        total = 0
        for text in texts:
            if len(text) > limit:  # a character is at least one byte: no need to encode it
                total = limit + 1
                break
            try:
                total += len(text.encode("utf-8"))
            except UnicodeEncodeError as exc:
                raise RequestError(
                    field,
                    f"{field} is not valid Unicode: {exc.reason} at position {exc.start} "
                    f"({text[exc.start : exc.end]!r}); a lone surrogate cannot be tokenized",
                ) from None
        if total > limit:
            raise RequestError(field, f"{field} is more than max_prompt_bytes={limit} bytes of UTF-8")

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a str or a list of int token ids, got {type(prompt).__name__}")

    def _validate(self, ids: list[int], params: SamplingParams) -> int:
        """Checks that the request can ever run; returns its max_new_tokens."""
        vocab = self.model_config.vocab_size
        if not ids:
            raise RequestError("prompt", "prompt must not be empty")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError("prompt", f"prompt token id {bad} is out of the vocabulary [0, {vocab})")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise RequestError(
                "stop_token_ids", f"stop_token_ids must be in [0, {vocab}) (the vocabulary), got {bad_stop!r}"
            )
        n = len(ids)
        if n >= self.max_seq_len:
            raise RequestError(
                "prompt",
                f"prompt length {n} must be < max_seq_len={self.max_seq_len} (room for one output token)",
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_seq_len:
            raise RequestError(
                "prompt",
                f"prompt length {n} + max_tokens {params.max_tokens} exceeds max_seq_len={self.max_seq_len}",
            )
        if not self.args.enable_chunked_prefill and n > self.args.max_num_tokens:
            raise RequestError(
                "prompt",
                f"prompt length {n} exceeds max_num_tokens={self.args.max_num_tokens}; raise it or "
                "set enable_chunked_prefill=True",
            )
        if params.n > self.args.max_n:
            raise RequestError("n", f"n must be <= max_n={self.args.max_n}, got {params.n}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.args.max_logprobs:
                raise RequestError(
                    name, f"{name} must be <= max_logprobs={self.args.max_logprobs}, got {value}"
                )
        if params.guided_decoding is not None:
            self._check_guided(params.guided_decoding, params)
        max_new = params.max_tokens if params.max_tokens is not None else self.max_seq_len - n
        if params.use_beam_search:
            self._check_beams(n, max_new, params)
        limit = self.args.max_request_tokens
        width = max(params.n, params.beam_width)
        if limit is not None and width * max_new > limit:
            what = "max_tokens" if params.max_tokens is not None else "the tokens that fit in max_seq_len"
            raise RequestError(
                "n",
                f"n x max_tokens = {width} x {max_new} ({what}) = {width * max_new} exceeds "
                f"max_request_tokens={limit}",
            )
        return max_new

    def _check_beams(self, prompt_len: int, max_new: int, params: SamplingParams) -> None:
        """A beam request must be able to run: within max_beam_width, never recomputed
        (GUARANTEED_NO_EVICT, or MAX_UTILIZATION with swap preemption), and with KV room for all its beams
        to the end (else it would wait forever)."""
        k = params.beam_width
        if k > self.args.max_beam_width:
            raise RequestError(
                "best_of",
                f"best_of (the beam width) must be <= max_beam_width={self.args.max_beam_width}, got {k}",
            )
        sched = self.args.scheduler_config
        policy = getattr(sched.capacity_scheduler_policy, "name", str(sched.capacity_scheduler_policy))
        if policy == "MAX_UTILIZATION" and sched.preemption_mode != "swap":
            raise RequestError(
                "use_beam_search",
                "use_beam_search under capacity_scheduler_policy MAX_UTILIZATION needs "
                "SchedulerConfig(preemption_mode='swap') and a secondary KV tier (KvCacheConfig."
                "host_cache_size): a paused beam request is swapped out, never recomputed; got "
                f"preemption_mode={sched.preemption_mode!r}",
            )
        if policy not in ("GUARANTEED_NO_EVICT", "MAX_UTILIZATION"):
            raise RequestError(
                "use_beam_search",
                "use_beam_search needs capacity_scheduler_policy GUARANTEED_NO_EVICT (a beam request is "
                f"never paused), or MAX_UTILIZATION with preemption_mode='swap'; got {policy}",
            )
        kv = self.executor.kv_cache_manager
        if kv is not None:
            tpb = kv.tokens_per_block
            shared = prompt_len // tpb
            total = -(-(prompt_len + max_new) // tpb)
            needed = shared + (total - shared) * k
            if needed > kv.num_blocks:
                raise RequestError(
                    "best_of",
                    f"beam search with best_of={k} beams over prompt {prompt_len} + max_tokens {max_new} "
                    f"needs {needed} KV blocks of {tpb} tokens, more than the pool's {kv.num_blocks}; "
                    "lower best_of or max_tokens",
                )

    def _check_guided(self, guided, params: SamplingParams) -> None:
        """A guided request needs the grammar backend, and a grammar that is well formed."""
        decoder = getattr(self.executor, "guided", None)
        if decoder is None:
            raise RequestError(
                "guided_decoding",
                "guided_decoding needs llguidance (pip install 'inflight-llm[structured]') and a model "
                "with a fast tokenizer",
            )
        kind, _ = guided.kind()
        for name in ("min_tokens", "ignore_eos"):
            if getattr(params, name):
                raise RequestError(
                    name, f"{name} cannot be combined with guided_decoding (the grammar decides the end)"
                )
        error = decoder.backend.validate(guided)
        if error is not None:
            raise RequestError("guided_decoding", f"guided_decoding.{kind} is not valid: {error}")

    def _prediction_ids(self, params: SamplingParams) -> list[int] | None:
        """The tokens of ``params.prediction`` (no special tokens), bounded like a prompt."""
        if params.prediction is None or not params.speculative:
            return None
        if self.tokenizer is None:
            raise RequestError("prediction", "prediction needs a tokenizer; this model has none")
        self._check_text_size("prediction", [params.prediction])
        ids = list(self.tokenizer.encode(params.prediction, add_special_tokens=False))
        return ids or None

    def generate_async(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        streaming: bool = False,
        priority: float = 0.5,
    ) -> RequestHandle:
        """Submits one prompt; returns a :class:`RequestHandle` (future, awaitable, async-iterable)."""
        return self._submit(prompt, sampling_params, streaming, priority)

    def _submit(self, prompt, params, streaming, priority=0.5, prepared=None) -> RequestHandle:
        self._require_driver()
        if self._shutdown:
            raise RuntimeError("LLM is shut down")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text, ids = prepared if prepared is not None else self._tokenize(prompt)
        max_new = self._validate(ids, params)
        prediction = self._prediction_ids(params)
        cfg = self.model_config
        children = []
        if params.use_beam_search:
            if streaming:
                raise RequestError("stream", "use_beam_search cannot stream (beams change until the end)")
            return self._submit_beams(text, ids, max_new, params, priority)
        for i in range(params.n):
            child_params = (
                params if params.n == 1 or params.seed is None else params.replace(seed=params.seed + i)
            )
            state = SamplingState.create(
                child_params, cfg.vocab_size, ids, cfg.eos_token_ids, device=self.device
            )
            rid = next(self._ids)
            # Stop strings are matched on text here, so their requests report every token.
            report_each_token = streaming or bool(params.stop)
            child = ExecutorRequest(rid, ids, max_new, state, report_each_token, priority)
            child.py_prediction = prediction
            if i == 0 and params.prompt_logprobs is not None:  # the prompt is the same for all n
                child.py_prompt_logprobs = [None]
            children.append(child)
        handle = RequestHandle(
            [c.request_id for c in children],
            text,
            ids,
            params,
            streaming,
            self.tokenizer,
            self.executor.cancel_requests,
        )
        with self._lock:
            for c in children:
                self._handles[c.request_id] = handle
        try:
            with self.executor.arrivals():  # the n sequences start together
                for c in children:
                    self.executor.enqueue_request(c)
        except Exception:
            with self._lock:
                for c in children:
                    self._handles.pop(c.request_id, None)
            raise
        return handle

    def _submit_beams(self, text, ids, max_new, params, priority) -> RequestHandle:
        """One executor request for all the beams; its final response carries the n best."""
        kv = self.executor.kv_cache_manager
        if kv is not None and kv.window_groups:
            raise ValueError(
                "use_beam_search is not supported with KvCacheConfig(sliding_window_pools=True) yet; "
                "build the LLM without sliding_window_pools for beam search"
            )
        cfg = self.model_config
        state = SamplingState.create(params, cfg.vocab_size, ids, cfg.eos_token_ids, device=self.device)
        rid = next(self._ids)
        req = ExecutorRequest(rid, ids, max_new, state, False, priority, beam_width=params.beam_width)
        req.py_beam = BeamSearch(params, rid, ids, state.eos_token_ids, max_new, self.max_seq_len)
        if params.prompt_logprobs is not None:
            req.py_prompt_logprobs = [None]
        handle = RequestHandle(
            [rid], text, ids, params, False, self.tokenizer, self.executor.cancel_requests, beams=True
        )
        with self._lock:
            self._handles[rid] = handle
        try:
            self.executor.enqueue_request(req)
        except Exception:
            with self._lock:
                self._handles.pop(rid, None)
            raise
        return handle

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's offline beam search: one :class:`BeamSearchOutput` per prompt, with all
        ``beam_width`` beams, best first (their tokens include the prompt's, as vLLM returns them)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        outs = self.generate(list(prompts), params.sampling_params(), use_tqdm=use_tqdm)
        return [BeamSearchOutput.from_request_output(o) for o in outs]

    def _on_responses(self, responses: list[Response]) -> None:
        """Executor thread: one iteration's responses, grouped by handle (each handle then builds one
        output for the iteration, however many of its sequences moved: O(n) per step for n)."""
        by_handle: dict[int, tuple[RequestHandle, list[Response]]] = {}
        with self._lock:
            for resp in responses:
                handle = self._handles.get(resp.request_id)
                if resp.finished:
                    self._handles.pop(resp.request_id, None)
                if handle is not None:
                    by_handle.setdefault(id(handle), (handle, []))[1].append(resp)
        for handle, resps in by_handle.values():
            try:
                handle.on_responses(resps)
            except Exception:  # one broken handle must not keep the others' responses
                logger.exception("delivering responses to request %d failed", handle.request_id)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> RequestOutput | list[RequestOutput]:
        """One prompt (a str or a list of token ids) in -> one RequestOutput; a list in -> a list."""
        self._require_driver()
        if not isinstance(prompts, (str, list, tuple)):
            raise ValueError(
                "prompts must be a str, a list of token ids, or a list of those, got "
                f"{type(prompts).__name__}"
            )
        single = isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple))
            and len(prompts) > 0
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts)
        )
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
            raise ValueError(
                "sampling_params must be a SamplingParams or a list of them, got "
                f"{type(sampling_params).__name__}"
            )
        for sp in params:
            if sp is not None and not isinstance(sp, SamplingParams):
                raise ValueError(
                    f"sampling_params must be SamplingParams, got an item of type {type(sp).__name__}"
                )
        # Validate everything before submitting anything: a bad prompt fails the call, not half of it.
        prepared = [self._tokenize(p) for p in plist]
        for (_, ids), sp in zip(prepared, params):
            self._validate(ids, sp if sp is not None else SamplingParams())
        with self.executor.arrivals():  # one schedule for the batch, however fast this thread submits
            handles = [
                self._submit(p, sp, False, prepared=pre) for p, sp, pre in zip(plist, params, prepared)
            ]
        outputs = self._wait_all(handles, use_tqdm)
        return outputs[0] if single else outputs

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> RequestOutput | list[RequestOutput]:
        """Generates replies to one conversation (a list of {"role", "content"} messages) or to a list
        of conversations, through the model's chat template."""
        self._require_driver()
        single = len(messages) > 0 and isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        outs = self.generate(prompts, sampling_params, use_tqdm)
        return outs[0] if single else outs

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """The token ids of a conversation rendered by the model's chat template."""
        if self.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer, so it has no chat template")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model's tokenizer has no chat template")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            raise ValueError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
        self._check_text_size("messages", [m["content"] for m in messages])
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        # The template already holds the special tokens; do not add a BOS on top.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _wait_all(self, handles: list[RequestHandle], use_tqdm: bool) -> list[RequestOutput]:
        if not use_tqdm:
            return [h.result() for h in handles]
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
                    bar.set_postfix_str(
                        f"input {n_in / dt:.1f} tok/s, output {n_out / dt:.1f} tok/s", refresh=False
                    )
                    bar.update(len(finished_now))
        return [h.result() for h in handles]

    # ------------------------------------------------------------------ stats and lifetime
    def get_stats(self) -> list[dict]:
        """One dict per recent iteration, oldest first (see docs/api.md for the keys)."""
        if self.executor is None:
            return []
        return self.executor.get_stats()

    @property
    def stall_seconds(self) -> float:
        """Seconds the engine has had work pending without finishing an iteration (0 when idle)."""
        return self.executor.stall_seconds if self.executor is not None else 0.0

    @property
    def is_alive(self) -> bool:
        """Whether the engine accepts and runs requests (not shut down, its loop not dead)."""
        return not self._shutdown and self.executor is not None and self.executor.is_alive

    def shutdown(self) -> None:
        """Finishes running requests, stops the executor, releases the KV pool and the weights."""
        if self._shutdown:
            return
        self._shutdown = True
        if self.executor is not None:
            self.executor.shutdown()
        if self.executor is not None and self.device.type == "cuda":
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
