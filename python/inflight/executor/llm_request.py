"""The executor's request: the C++ LlmRequest plus the Python-side state (``py_`` attributes).

The C++ part (scheduling state, tokens, the sequence slot, the finish reason) goes straight into the
C++ schedulers; the ``py_`` attributes carry what only Python needs: the sampling state, streaming
offsets, timings, logprobs, an error message.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from inflight.batch_manager import FinishReason, LlmRequest
from inflight.executor.sampler import SamplingState

# The API's finish_reason for each C++ FinishReason of a finished request (vLLM / OpenAI names).
FINISH_REASON_NAMES = {
    FinishReason.END_ID: "stop",
    FinishReason.STOP_WORDS: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "cancelled",
    FinishReason.TIMED_OUT: "timed_out",
}


class ExecutorRequest(LlmRequest):
    """A request as the executor runs it. Finished means state GENERATION_COMPLETE; then either
    ``finish_reason`` (C++) says why, or ``py_error`` holds the engine failure that ended it."""

    def __init__(
        self,
        request_id: int,
        prompt_token_ids: list[int],
        max_new_tokens: int,
        sampling_state: SamplingState,
        streaming: bool = False,
        priority: float = 0.5,
        beam_width: int = 1,
    ):
        # beam_width: the C++ capacity planner and micro-batch scheduler count K rows and K beams' blocks.
        super().__init__(request_id, max_new_tokens, prompt_token_ids, priority, beam_width)
        # The C++ max_new_tokens shrinks when a pause folds tokens into the prompt; this does not.
        self.py_max_new_tokens = max_new_tokens
        self.py_sampling_state = sampling_state
        self.py_streaming = streaming  # a response for every token, not only the final one
        self.py_num_returned = 0  # output tokens already sent in a response
        self.py_logprobs: list[dict[int, float]] = []  # one dict per output token, when requested
        self.py_cumulative_logprob = 0.0
        # SamplingParams.prompt_logprobs: None for the first prompt token, then one dict per prompt
        # token as its positions are computed (None: not asked for). ``py_prompt_rows_planned``: the
        # prompt positions a prepared step already scores (chunks ahead of their outputs, overlap).
        self.py_prompt_logprobs: list[dict[int, float] | None] | None = None
        self.py_prompt_rows_planned = 0
        self.py_stop_reason: int | None = None  # the stop token id, when one ended the request
        self.py_error: str | None = None
        self.py_num_preemptions = 0
        # Speculative decoding: OpenAI's predicted output as token ids (drafts), and the request's
        # drafting state (created by the Speculator on first use).
        self.py_prediction: list[int] | None = None
        self.py_spec = None
        # Structured output: the request's GrammarMatcher, once its grammar is compiled.
        self.py_guided = None
        # Beam search (SamplingParams.use_beam_search): the request's BeamSearch state.
        self.py_beam = None
        self.py_arrival_time = time.monotonic()
        self.py_first_scheduled_time: float | None = None
        self.py_first_token_time: float | None = None
        self.py_finish_time: float | None = None

    @property
    def py_num_output_tokens(self) -> int:
        return self.num_tokens - self.orig_prompt_len

    @property
    def py_done(self) -> bool:
        return self.is_finished

    @property
    def py_finish_reason(self) -> str | None:
        """ "stop" | "length" | "cancelled" | "timed_out" | "error", None while running."""
        if not self.is_finished:
            return None
        if self.py_error is not None:
            return "error"
        return FINISH_REASON_NAMES.get(self.finish_reason)


@dataclass
class Response:
    """One message from the executor about one request: new tokens (a delta) and/or the end."""

    request_id: int
    new_token_ids: list[int]
    num_output_tokens: int  # output tokens so far, this response's included
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # in the request's first response
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    # Beam search: the returned beams (BeamHypothesis, best first), in the final response only.
    beams: list | None = None


def request_metrics(req) -> dict[str, float]:
    """A finished request's timings (seconds) and preemption count, as its response reports them."""
    m = {"arrival_time": req.py_arrival_time, "num_preemptions": req.py_num_preemptions}
    if req.py_first_scheduled_time is not None:
        m["queue_time"] = req.py_first_scheduled_time - req.py_arrival_time
    if req.py_first_token_time is not None:
        m["ttft"] = req.py_first_token_time - req.py_arrival_time
    if req.py_finish_time is not None:
        m["e2e_latency"] = req.py_finish_time - req.py_arrival_time
    spec = getattr(req, "py_spec", None)
    if spec is not None:  # speculative decoding: draft tokens scored, and of those kept
        m["num_draft_tokens"] = spec.num_drafted
        m["num_accepted_draft_tokens"] = spec.num_accepted
    return m


def format_iteration_stats(stat: dict) -> str:
    """One iteration's stats entry as the log line ``log_iteration_stats`` prints."""
    kv = stat["kv_cache_stats"]
    line = (
        f"iter {stat['iter']}: running {stat['num_scheduled_requests']} (ctx {stat['num_context_requests']}, "
        f"gen {stat['num_generation_requests']}), waiting {stat['num_waiting_requests']}, paused "
        f"{stat['num_paused_requests']}, tokens {stat['num_tokens']}, KV used {kv.get('used_num_blocks', 0)}/"
        f"{kv.get('max_num_blocks', 0)} blocks, prefix hit rate {100 * kv.get('cache_hit_rate', 0.0):.1f}%, "
        f"{stat['iter_latency_ms']:.1f} ms"
    )
    if "parallel" in stat:
        line += f", {stat['parallel']}, {stat['num_micro_batches_in_flight']} micro-batch(es) in flight"
    return line
