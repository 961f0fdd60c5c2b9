"""Results of the LLM API (vLLM / TensorRT-LLM shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence. ``token_ids`` include a final EOS/stop token when generation stopped
    on it; ``text`` excludes it. ``text_diff`` / ``token_ids_diff``: what is new since the previous
    streamed output of this request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    stop_reason: int | str | None = None
    error: str | None = None
    text_diff: str = ""
    token_ids_diff: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.token_ids)


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: None for the first prompt token, then {token: logprob} per
    # prompt token (the prompt's own token first, then the top ones); None when not asked for.
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class BeamSearchSequence:
    """One beam of :meth:`inflight.LLM.beam_search` (vLLM's shape): ``tokens`` are the prompt's then the
    generated ones, ``text`` their decoded text, ``cum_logprob`` the generated tokens' summed
    log-probability."""

    tokens: list[int]
    logprobs: list[dict[int, float]] | None
    cum_logprob: float
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]

    @classmethod
    def from_request_output(cls, out: RequestOutput) -> BeamSearchOutput:
        prompt = list(out.prompt_token_ids)
        return cls(
            [
                BeamSearchSequence(
                    prompt + list(c.token_ids),
                    c.logprobs,
                    c.cumulative_logprob if c.cumulative_logprob is not None else 0.0,
                    (out.prompt or "") + c.text if c.error is None else None,
                    c.finish_reason,
                    c.stop_reason,
                )
                for c in out.outputs
            ]
        )
