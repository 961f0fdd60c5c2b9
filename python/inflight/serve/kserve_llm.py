"""The LLM model interface of Triton's TensorRT-LLM backend (its ``ensemble`` model), shared by the
KServe HTTP routes (:mod:`.kserve`) and gRPC (:mod:`.kserve_grpc`): the inputs and outputs, one request
row as :class:`LLMRequest` (its :class:`~inflight.sampling_params.SamplingParams`), the outputs of
finished rows as tensors, and the errors (:class:`KServeError`) in Triton's words.

Inputs ``text_input`` (BYTES) and ``max_tokens`` (INT32), optional ``stream``, ``temperature``,
``top_k``, ``top_p``, ``random_seed``, ``stop_words``, ``bad_words``, ``repetition_penalty``,
``presence_penalty``, ``frequency_penalty``, ``length_penalty``, ``min_length``, ``end_id``,
``pad_id``, ``return_log_probs``, ``beam_width``, ``exclude_input_in_output``; outputs
``text_output``, ``cum_log_probs``, ``output_log_probs``. An input it does not know is refused by
name, as Triton refuses it. As in TensorRT-LLM, a request with neither ``top_k`` nor ``top_p`` (or
both 0) is greedy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from inflight.sampling_params import SamplingParams

# (name, datatype, dims, optional): the TensorRT-LLM backend's ensemble interface.
INPUTS = [
    ("text_input", "BYTES", [1], False),
    ("max_tokens", "INT32", [1], False),
    ("stream", "BOOL", [1], True),
    ("temperature", "FP32", [1], True),
    ("top_k", "INT32", [1], True),
    ("top_p", "FP32", [1], True),
    ("random_seed", "UINT64", [1], True),
    ("stop_words", "BYTES", [-1], True),
    ("bad_words", "BYTES", [-1], True),
    ("repetition_penalty", "FP32", [1], True),
    ("presence_penalty", "FP32", [1], True),
    ("frequency_penalty", "FP32", [1], True),
    ("length_penalty", "FP32", [1], True),
    ("min_length", "INT32", [1], True),
    ("end_id", "INT32", [1], True),
    ("pad_id", "INT32", [1], True),
    ("return_log_probs", "BOOL", [1], True),
    ("beam_width", "INT32", [1], True),
    ("exclude_input_in_output", "BOOL", [1], True),
]
OUTPUTS = [
    ("text_output", "BYTES", [-1]),
    ("cum_log_probs", "FP32", [-1]),
    ("output_log_probs", "FP32", [-1, -1]),
]
_INPUT_TYPES = {name: dt for name, dt, _, _ in INPUTS}
_LISTS = {"stop_words", "bad_words"}
_TRITON_TYPE = {
    "BYTES": "TYPE_STRING",
    "INT32": "TYPE_INT32",
    "UINT64": "TYPE_UINT64",
    "FP32": "TYPE_FP32",
    "BOOL": "TYPE_BOOL",
}


class KServeError(Exception):
    """An error answered as ``{"error": message}`` with an HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


# ---------------------------------------------------------------------------------------------- requests


@dataclass
class LLMRequest:
    """One row of an LLM request: its prompt, sampling parameters and output options."""

    text: str
    params: SamplingParams
    exclude_input: bool
    return_log_probs: bool
    stream: bool


def _scalar(name: str, value: Any, kind: type) -> Any:
    if isinstance(value, np.ndarray):
        if value.size != 1:
            raise KServeError(400, f"input '{name}' must hold one value per request row, got {value.size}")
        value = value.reshape(-1)[0]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if kind is bool:
        if not isinstance(value, bool):
            raise KServeError(400, f"input '{name}' must be a boolean, got {value!r}")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise KServeError(400, f"input '{name}' must be an integer, got {value!r}")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise KServeError(400, f"input '{name}' must be a number, got {value!r}")
        value = float(value)
    elif not isinstance(value, str):
        raise KServeError(400, f"input '{name}' must be a string, got {value!r}")
    return value


def _words(name: str, value: Any) -> list[str]:
    if isinstance(value, np.ndarray):
        value = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in value.reshape(-1)]
    elif isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(w, str) for w in value):
        raise KServeError(400, f"input '{name}' must be a string or a list of strings, got {value!r}")
    # The TensorRT-LLM backend takes comma-separated words in one element too.
    return [w.strip() for item in value for w in item.split(",") if w.strip()]


_KINDS = {"BYTES": str, "INT32": int, "UINT64": int, "FP32": float, "BOOL": bool}


def _bad_words_processor(tokenizer, words: list[str]):
    """TensorRT-LLM's bad words: no output ends with any of these token sequences."""
    seqs = [tuple(tokenizer.encode(w, add_special_tokens=False)) for w in words]
    seqs = [s for s in seqs if s]

    def ban(output_ids: list[int], logits):
        for seq in seqs:
            head = seq[:-1]
            if not head or tuple(output_ids[-len(head) :]) == head:
                logits[seq[-1]] = float("-inf")
        return logits

    return ban


def llm_request(values: dict[str, Any], tokenizer) -> LLMRequest:
    """One row's fields (python or numpy values, by input name) as an :class:`LLMRequest`. Unknown
    names and wrong types are errors naming the input."""
    for name in values:
        if name not in _INPUT_TYPES:
            raise KServeError(
                400, f"unexpected inference input '{name}', allowed inputs are: {', '.join(_INPUT_TYPES)}"
            )
    v = {}
    for name, value in values.items():
        if value is None:
            continue
        v[name] = _words(name, value) if name in _LISTS else _scalar(name, value, _KINDS[_INPUT_TYPES[name]])
    for name in ("text_input", "max_tokens"):
        if name not in v:
            raise KServeError(400, f"expected input '{name}' is missing")
    kwargs: dict[str, Any] = {"max_tokens": v["max_tokens"]}
    beam_width = v.get("beam_width", 1)
    if beam_width > 1:
        kwargs.update(use_beam_search=True, best_of=beam_width, n=beam_width, temperature=0.0)
        if "length_penalty" in v:
            kwargs["length_penalty"] = v["length_penalty"]
    elif beam_width < 1:
        raise KServeError(400, f"input 'beam_width' must be >= 1, got {beam_width}")
    else:
        top_k, top_p = v.get("top_k", 0), v.get("top_p", 0.0)
        if top_k == 0 and top_p == 0.0:  # TensorRT-LLM: neither set is greedy
            kwargs["temperature"] = 0.0
        else:
            kwargs.update(
                temperature=v.get("temperature", 1.0), top_k=top_k, top_p=top_p if top_p > 0 else 1.0
            )
    for src, dst in (
        ("repetition_penalty", "repetition_penalty"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
        ("min_length", "min_tokens"),
    ):
        if src in v:
            kwargs[dst] = v[src]
    if "random_seed" in v:
        if not 0 <= v["random_seed"] < 2**63:
            raise KServeError(400, f"input 'random_seed' must be in [0, 2**63), got {v['random_seed']}")
        kwargs["seed"] = v["random_seed"]
    if v.get("stop_words"):
        kwargs["stop"] = v["stop_words"]
    if "end_id" in v:  # replaces EOS, as in TensorRT-LLM
        kwargs.update(stop_token_ids=[v["end_id"]], ignore_eos=True)
    if v.get("bad_words"):
        if tokenizer is None:
            raise KServeError(400, "input 'bad_words' needs a tokenizer; this model has none")
        kwargs["logits_processors"] = [_bad_words_processor(tokenizer, v["bad_words"])]
    if v.get("return_log_probs"):
        kwargs["logprobs"] = 0
    try:
        params = SamplingParams(**kwargs)
    except ValueError as exc:
        raise KServeError(400, _rename(str(exc))) from None
    return LLMRequest(
        v["text_input"],
        params,
        bool(v.get("exclude_input_in_output", False)),
        bool(v.get("return_log_probs")),
        bool(v.get("stream")),
    )


_RENAMES = {
    "min_tokens": "min_length",
    "seed": "random_seed",
    "stop ": "stop_words ",
    "logits_processors": "bad_words",
}


def _rename(message: str) -> str:
    """A SamplingParams message in this interface's input names."""
    for ours, theirs in _RENAMES.items():
        if message.startswith(ours):
            return f"input '{theirs.strip()}': " + message
    return "invalid inference request: " + message


def rows_of(tensors: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """The request rows of a tensor batch: row i takes element i of each input's first dimension
    (an input of batch 1 applies to every row)."""
    if "text_input" not in tensors:
        raise KServeError(400, "expected input 'text_input' is missing")
    for name in tensors:
        if name not in _INPUT_TYPES:
            raise KServeError(
                400, f"unexpected inference input '{name}', allowed inputs are: {', '.join(_INPUT_TYPES)}"
            )
    text = tensors["text_input"]
    batch = text.shape[0] if text.ndim else 1
    rows = []
    for i in range(batch):
        row = {}
        for name, arr in tensors.items():
            if arr.ndim == 0:
                row[name] = arr
            elif arr.shape[0] == batch:
                row[name] = arr[i]
            elif arr.shape[0] == 1:
                row[name] = arr[0]
            else:
                raise KServeError(
                    400, f"input '{name}' has batch size {arr.shape[0]}, but 'text_input' has {batch}"
                )
        rows.append(row)
    return rows


def _check_types(items: list[dict]) -> None:
    for item in items:
        want = _INPUT_TYPES.get(item["name"])
        if want is not None and item.get("datatype") != want:
            raise KServeError(
                400,
                f"unexpected datatype {_TRITON_TYPE.get(item.get('datatype'), item.get('datatype'))} for "
                f"inference input '{item['name']}', expecting {_TRITON_TYPE[want]}",
            )


def schedule_parameters(params: dict[str, Any]) -> tuple[int, int | None]:
    """A request's ``priority`` and ``timeout`` (microseconds) parameters (Triton's schedule policy)."""
    out = []
    for name in ("priority", "timeout"):
        value = params.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise KServeError(400, f"parameter '{name}' must be an integer >= 0, got {value!r}")
        out.append(value)
    return out[0], out[1] or None


def _failure(comp) -> KServeError | None:
    if comp.finish_reason == "error":
        return KServeError(500, f"the inference engine failed on this request: {comp.error}")
    if comp.finish_reason == "cancelled":
        return KServeError(400, "the request was cancelled")
    return None


def _outputs(rows: list[LLMRequest], outs: list) -> dict[str, np.ndarray]:
    """text_output [B, beams], cum_log_probs [B, beams], output_log_probs [B, beams, L] (0-padded)."""
    beams = max(len(o.outputs) for o in outs)
    texts = np.empty((len(outs), beams), dtype=np.object_)
    cum = np.zeros((len(outs), beams), dtype=np.float32)
    longest = max((len(c.token_ids) for o in outs for c in o.outputs), default=0)
    lps = np.zeros((len(outs), beams, longest), dtype=np.float32)
    for i, (row, out) in enumerate(zip(rows, outs)):
        for j in range(beams):
            comp = out.outputs[j] if j < len(out.outputs) else None
            if comp is None:
                texts[i, j] = b""
                continue
            if (err := _failure(comp)) is not None:
                raise err
            text = comp.text if row.exclude_input else row.text + comp.text
            texts[i, j] = text.encode()
            if row.return_log_probs and comp.logprobs:
                vals = [e[t] for t, e in zip(comp.token_ids, comp.logprobs)]
                lps[i, j, : len(vals)] = vals
                cum[i, j] = comp.cumulative_logprob or 0.0
    return {"text_output": texts, "cum_log_probs": cum, "output_log_probs": lps}
