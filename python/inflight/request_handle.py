"""What ``LLM.generate_async`` returns: a :class:`RequestHandle` over the executor's responses.

The executor thread calls :meth:`RequestHandle.on_responses` once per iteration with that iteration's
responses of the request's sequences (one per ``n``); callers read the handle as a future (``result()``), an awaitable,
or, when streaming, an async iterator of cumulative :class:`~inflight.outputs.RequestOutput` whose
``text_diff`` / ``token_ids_diff`` hold what is new. Each sequence's text comes from an
:class:`~inflight.detokenizer.IncrementalDetokenizer`, and stop strings are found here, on the text
(the executor knows only tokens): a stop string ends the sequence at once and cancels its executor
request.

Streamed text is only what later tokens cannot change: while a sequence runs, the last
``max(len(stop)) - 1`` characters are held back (they may yet start a stop string that is cut off),
and so is an incomplete UTF-8 character (the detokenizer holds it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable

from inflight.detokenizer import IncrementalDetokenizer
from inflight.executor.llm_request import Response
from inflight.outputs import CompletionOutput, RequestOutput
from inflight.sampling_params import SamplingParams

# Per-request metrics of speculative decoding (RequestOutput.metrics), summed over a request's sequences.
DRAFT_METRICS = ("num_draft_tokens", "num_accepted_draft_tokens")

__all__ = ["RequestHandle"]


class RequestHandle:
    """A submitted prompt: a future (``result()``), awaitable, async-iterable when streaming, and
    abortable. It binds to the event loop that first awaits or iterates it.

    ``request_ids``: the executor requests of its sequences (one per ``n``); ``cancel(request_ids)``
    cancels some of them in the executor, in one call.
    """

    def __init__(
        self,
        request_ids: list[int],
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        streaming: bool,
        tokenizer,
        cancel: Callable[[list[int]], None],
        beams: bool = False,
    ):
        self._ids = list(request_ids)
        self.request_id = self._ids[0]
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.streaming = streaming
        self._cancel = cancel
        # Beam search: one executor request whose final response holds the n beams.
        self._beams = beams
        num_seqs = params.n if beams else len(self._ids)
        self._seqs = [_Sequence(i, params, tokenizer, streaming) for i in range(num_seqs)]
        self._by_id = dict(zip(self._ids, self._seqs))
        self._cond = threading.Condition()
        self._stream: list[RequestOutput] = []
        self._final: RequestOutput | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._metrics: dict[str, float] = {}
        self._prompt_logprobs: list | None = None  # SamplingParams.prompt_logprobs (from sequence 0)

    # -- executor thread
    def on_responses(self, responses: list[Response]) -> None:
        """One iteration's responses: every sequence updated, then one output (not one per response,
        which would cost O(n^2) per step for n sequences)."""
        stopped = []
        with self._cond:
            changed = False
            for resp in responses:
                if self._beams:
                    changed = self._take_beams(resp) or changed
                    continue
                seq = self._by_id[resp.request_id]
                if seq.finished:
                    continue  # e.g. the cancellation that follows a stop string found here
                changed = True
                if resp.prompt_logprobs is not None and self._prompt_logprobs is None:
                    self._prompt_logprobs = resp.prompt_logprobs
                if seq.update(resp):
                    stopped.append(resp.request_id)
                if resp.finished and resp.metrics:
                    # Timings: the last sequence's; draft-token counts: summed over the sequences.
                    summed = {
                        k: self._metrics.get(k, 0) + resp.metrics[k]
                        for k in DRAFT_METRICS
                        if k in resp.metrics
                    }
                    self._metrics = {**resp.metrics, **summed}
            if not changed:
                return
            done = all(s.finished for s in self._seqs)
            if self.streaming:
                self._stream.append(self._snapshot(done, diff=True))
            if done:
                self._final = self._snapshot(True, diff=False)
            self._cond.notify_all()
            loop, event = self._loop, self._event
        if stopped:
            self._cancel(stopped)
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop was closed
                pass

    def _take_beams(self, resp: Response) -> bool:
        """A beam request's final response: sequence i gets beam i (a failure: every sequence gets the
        error; a search cut short before any token: empty sequences)."""
        if not resp.finished:
            return False
        if resp.prompt_logprobs is not None and self._prompt_logprobs is None:
            self._prompt_logprobs = resp.prompt_logprobs
        beams = resp.beams or []
        for i, seq in enumerate(self._seqs):
            if seq.finished:
                continue
            if i < len(beams):
                b = beams[i]
                part = dataclasses.replace(
                    resp,
                    new_token_ids=list(b.token_ids),
                    num_output_tokens=len(b.token_ids),
                    finish_reason=resp.finish_reason
                    if resp.finish_reason not in ("stop", "length")
                    else b.finish_reason,
                    stop_reason=b.stop_reason,
                    new_logprobs=b.logprobs,
                    cumulative_logprob=b.cumulative_logprob,
                    beams=None,
                )
            else:
                part = dataclasses.replace(
                    resp, new_token_ids=[], num_output_tokens=0, new_logprobs=None, beams=None
                )
            seq.update(part)
        self._metrics = dict(resp.metrics)
        return True

    def _snapshot(self, finished: bool, diff: bool) -> RequestOutput:
        outs = [s.output(diff) for s in self._seqs]
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outs,
            finished,
            dict(self._metrics),
            self._prompt_logprobs,  # complete when it arrives; shared, not copied per output
        )

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
        running = [rid for rid, seq in zip(self._ids, self._seqs) if not seq.finished]
        if running:
            self._cancel(running)

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


class _Sequence:
    """One output sequence of a request: tokens, text, stop strings, finish."""

    def __init__(self, index: int, params: SamplingParams, tokenizer, streaming: bool):
        self.index = index
        self.params = params
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
            if tokenizer is not None and params.detokenize
            else None
        )
        # Without streaming or stop strings nobody reads the text before the end: decode once, then.
        self.decode_each_step = streaming or bool(params.stop)
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = None
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self._num_decoded = 0  # tokens given to the detokenizer
        self._sent_tokens = 0
        self._sent_text = 0
        self._max_stop = max((len(s) for s in params.stop), default=0)
        # The last max_stop - 1 characters may yet start a stop string that is cut off (unless it
        # is kept in the output).
        self._hold = self._max_stop - 1 if self._max_stop and not params.include_stop_str_in_output else 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, resp: Response) -> bool:
        """Takes a response; True when a stop string ended the sequence here (while the executor
        request is still running, so the caller cancels it). A response of several tokens (speculative
        decoding) is taken one token at a time while stop strings are watched, so the sequence ends
        at the token that completes one, as it would have without speculation."""
        ids = resp.new_token_ids
        if len(ids) < 2 or not self.params.stop or self.detokenizer is None:
            return self._update(resp)
        lps = resp.new_logprobs
        later = [0.0] * len(ids)  # the log-probabilities of the tokens after each (cumulative_logprob)
        if lps and resp.cumulative_logprob is not None:
            for i in range(len(ids) - 2, -1, -1):
                later[i] = later[i + 1] + lps[i + 1][ids[i + 1]]
        for i, tok in enumerate(ids):
            last = i == len(ids) - 1
            part = dataclasses.replace(
                resp,
                new_token_ids=[tok],
                num_output_tokens=resp.num_output_tokens - (len(ids) - 1 - i),
                finished=resp.finished and last,
                finish_reason=resp.finish_reason if last else None,
                stop_reason=resp.stop_reason if last else None,
                new_logprobs=lps[i : i + 1] if lps is not None else None,
                cumulative_logprob=(
                    resp.cumulative_logprob - later[i] if resp.cumulative_logprob is not None else None
                ),
                error=resp.error if last else None,
            )
            if self._update(part) or self.finished:
                return not resp.finished and self.finished
        return False

    def _update(self, resp: Response) -> bool:
        self.token_ids.extend(resp.new_token_ids)
        if self.logprobs is not None and resp.new_logprobs:
            self.logprobs.extend(resp.new_logprobs)
        if resp.cumulative_logprob is not None:
            self.cumulative_logprob = resp.cumulative_logprob
        stop_str = None
        if self.detokenizer is not None and (self.decode_each_step or resp.finished):
            stop_str = self._detokenize(resp)
        if stop_str is not None:
            self.finish_reason, self.stop_reason = "stop", stop_str
            return not resp.finished
        if resp.finished:
            self.finish_reason, self.stop_reason, self.error = (
                resp.finish_reason,
                resp.stop_reason,
                resp.error,
            )
        return False

    def _detokenize(self, resp: Response) -> str | None:
        """Feeds the new tokens to the detokenizer; returns the stop string that ends the text, if one
        appeared."""
        end = len(self.token_ids)
        if resp.finished and resp.finish_reason == "stop" and end:
            end -= 1  # the EOS / stop token is in token_ids, not in the text
        prev_len = len(self.text)
        self.detokenizer.add(self.token_ids[self._num_decoded : end])
        self._num_decoded = max(self._num_decoded, end)
        if resp.finished:
            self.detokenizer.flush()
        self.text = self.detokenizer.text
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
        without the characters that may start a stop string (``_hold``)."""
        text = self.text
        if not self.finished and self._hold:
            text = text[: max(len(text) - self._hold, 0)]
        return text

    def output(self, diff: bool) -> CompletionOutput:
        text = self._stable_text()
        out = CompletionOutput(
            self.index,
            text,
            list(self.token_ids),
            self.cumulative_logprob,
            list(self.logprobs) if self.logprobs is not None else None,
            self.finish_reason,
            self.stop_reason,
            self.error,
        )
        if diff:
            out.text_diff = text[self._sent_text :]
            out.token_ids_diff = self.token_ids[self._sent_tokens :]
            self._sent_text, self._sent_tokens = len(text), len(self.token_ids)
        return out
