"""The executor's request: the C++ LlmRequest plus the Python-side state (py_ attributes).

The C++ part (scheduling state, tokens) goes straight into the C++ schedulers; the py_ attributes
carry what only Python needs: sampling parameters and state, streaming offsets, timings, results.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from inflight.batch_manager import LlmRequest


class ExecutorRequest(LlmRequest):
    def __init__(
        self,
        request_id: int,
        prompt_token_ids: list[int],
        max_new_tokens: int,
        sampling_params: Any,
        sampling_state: Any,
        streaming: bool = False,
        priority: float = 0.5,
    ):
        super().__init__(request_id, max_new_tokens, prompt_token_ids, priority)
        # The C++ max_new_tokens shrinks when a pause folds tokens into the prompt; this does not.
        self.py_max_new_tokens = max_new_tokens
        self.py_sampling_params = sampling_params
        self.py_sampling_state = sampling_state
        self.py_streaming = streaming
        self.py_num_returned = 0  # output tokens already sent in a response
        self.py_logprobs: list[dict[int, float]] = []  # one dict per output token, when requested
        self.py_cumulative_logprob = 0.0
        self.py_finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
        self.py_stop_reason: int | str | None = None
        self.py_error: str | None = None
        self.py_cancel_requested = False
        self.py_num_preemptions = 0
        self.py_arrival_time = time.monotonic()
        self.py_first_scheduled_time: float | None = None
        self.py_first_token_time: float | None = None
        self.py_finish_time: float | None = None

    @property
    def py_num_output_tokens(self) -> int:
        return self.num_tokens - self.orig_prompt_len

    @property
    def py_done(self) -> bool:
        return self.py_finish_reason is not None


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
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
