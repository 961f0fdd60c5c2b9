"""Pieces of the response bodies that the plain and the streamed answers share: the header, usage,
an output's failure as an :class:`~inflight.serve.protocol.APIError`, and logprobs in OpenAI's two
shapes (legacy completions, chat)."""

from __future__ import annotations

import math

from inflight.serve.protocol import APIError
from inflight.serve.state import ServerState


def header(state: ServerState, kind: str, rid: str, created: int) -> dict:
    return {"id": rid, "object": kind, "created": created, "model": state.model_name}


def usage(prompt_tokens: int, completion_tokens: int, predicted_outputs=None) -> dict:
    """OpenAI's usage object; ``predicted_outputs``: the finished outputs of a request with a
    ``prediction``, whose draft-token counts become ``completion_tokens_details``."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if predicted_outputs is not None:
        outs = [o for o in predicted_outputs if o is not None]
        drafted = sum(o.metrics.get("num_draft_tokens", 0) for o in outs)
        accepted = sum(o.metrics.get("num_accepted_draft_tokens", 0) for o in outs)
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        }
    return out


def failure(comp) -> APIError | None:
    """The error a finished output stands for (an engine error, a cancellation), else None."""
    if comp.finish_reason == "error":
        return APIError(
            500,
            f"the engine failed on this request: {comp.error or 'unknown error'}",
            type="server_error",
            code="engine_error",
        )
    if comp.finish_reason == "cancelled":
        return APIError(
            503,
            "the request was cancelled (the server is shutting down)",
            type="service_unavailable",
            code="request_cancelled",
        )
    return None


def _finite(x: float) -> float:
    # JSON has no -inf; a token of probability 0 gets vLLM's floor.
    return x if math.isfinite(x) else -9999.0


def completion_logprobs(state: ServerState, token_ids: list[int], entries: list[dict], offset: int) -> dict:
    """OpenAI's legacy completions logprobs for some tokens (``offset``: text length before them)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        s = state.token_str(tid)
        tokens.append(s)
        token_lps.append(_finite(entry.get(tid, -math.inf)))
        tops.append({state.token_str(t): _finite(lp) for t, lp in entry.items()})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(state: ServerState, token_ids: list[int], entries: list[dict], top_n: int) -> dict:
    """Chat's logprobs: per token its own and the ``top_n`` most likely, with their bytes."""
    content = []
    for tid, entry in zip(token_ids, entries):
        s = state.token_str(tid)
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        top = []
        for t, lp in ranked:
            ts = state.token_str(t)
            top.append({"token": ts, "logprob": _finite(lp), "bytes": list(ts.encode())})
        content.append(
            {
                "token": s,
                "logprob": _finite(entry.get(tid, -math.inf)),
                "bytes": list(s.encode()),
                "top_logprobs": top,
            }
        )
    return {"content": content}


def prompt_logprobs(state: ServerState, entries: list[dict | None] | None) -> list | None:
    """vLLM's ``prompt_logprobs`` of a choice: None for the first prompt token, then per prompt token
    ``{"<token id>": {"logprob": float, "decoded_token": str}}`` (the prompt's own token first)."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": _finite(lp), "decoded_token": state.token_str(t)} for t, lp in entry.items()
        }
        for entry in entries
    ]


def new_entries(comp) -> tuple[list[int], list[dict]]:
    """The token ids and logprob entries of a streamed output's delta."""
    ids = comp.token_ids_diff
    if comp.logprobs is None:
        return ids, []
    start = len(comp.token_ids) - len(ids)
    return ids, comp.logprobs[start : start + len(ids)]
