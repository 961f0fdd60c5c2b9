"""The KServe v2 / Open Inference Protocol routes (Triton's HTTP API) beside the OpenAI ones.

Each served model answers under its name (the same as on the OpenAI routes), version "1", with the
LLM interface of Triton's TensorRT-LLM backend (:mod:`.kserve_llm`); ``text_output`` starts with the
prompt unless ``exclude_input_in_output`` is true (streamed responses carry only the new text).

Routes: ``GET /v2/health/live``, ``/v2/health/ready`` (200, or 400 when not ready, as Triton),
``GET /v2`` (server metadata), ``GET /v2/models/{m}[/versions/{v}]`` (metadata), ``…/ready``,
``…/config``, ``POST …/infer`` (JSON or the binary tensor extension, :mod:`.kserve_tensors`), and
Triton's generate extension ``POST …/generate`` / ``…/generate_stream`` (SSE), whose body is either
the TensorRT-LLM backend's (fields at the top level) or the Open Inference Protocol's (sampling
fields under ``parameters``), Triton's statistics and model-repository extensions. Errors are
``{"error": "..."}``.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from inflight.serve.batcher import BatcherError
from inflight.serve.kserve_llm import (
    _TRITON_TYPE,
    INPUTS,
    OUTPUTS,
    KServeError,
    LLMRequest,
    _check_types,
    _failure,
    _outputs,
    llm_request,
    rows_of,
    schedule_parameters,
)
from inflight.serve.kserve_tensors import HEADER_LENGTH, TensorError, decode_request, encode_response
from inflight.serve.protocol import APIError
from inflight.serve.routes import _gather_unless_disconnected
from inflight.serve.state import MODEL_VERSION, Job, ModelSet, ServerState
from inflight.serve.streaming import SSEResponse

EXTENSIONS = [
    "binary_tensor_data",
    "model_configuration",
    "model_repository",
    "schedule_policy",
    "parameters",
    "statistics",
    "generate",
]


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def kserve_route(fn):
    """Errors of the route (and of the shared server state) as KServe error bodies."""

    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
        except KServeError as exc:
            return _error(exc.status, exc.message)
        except TensorError as exc:
            return _error(400, str(exc))
        except (APIError, BatcherError) as exc:
            return _error(exc.status, exc.message)

    return wrapper


def _models(request: Request) -> ModelSet:
    return request.app.state.models


def model_state(models: ModelSet, model: str, version: str | None) -> ServerState:
    """The serving model of a KServe request, or Triton's error for a model that has none."""
    if version not in (None, "", MODEL_VERSION):
        raise KServeError(400, f"Request for unknown model: '{model}' version {version} is not found")
    state = models.lookup(model)
    if state is None:
        why = models.missing(model)
        if why in (None, "not found"):
            raise KServeError(400, f"Request for unknown model: '{model}' is not found")
        raise KServeError(400, f"Request for unknown model: '{model}' has no available versions ({why})")
    return state


def model_ready(state: ServerState) -> bool:
    return not state.draining and state.retiring is None and state.engine_alive()


def server_ready(models: ModelSet) -> bool:
    """Ready as Triton is: not draining, and every model that should serve does."""
    return not models.draining and all(model_ready(s) for s in models.serving()) and not models.failed()


def failure_reason(status: int) -> str:
    """Triton's ``reason`` label of a failed request, by its status."""
    return {503: "REJECTED", 499: "CANCELED", 500: "BACKEND"}.get(status, "OTHER")


def record_success(state: ServerState, job: Job, t0_ns: int, outs: list) -> None:
    """Triton's statistics of an answered request: its time in the batcher and the engine's queue,
    the rest as compute."""
    engine_queue = max(((o.metrics or {}).get("queue_time", 0.0) for o in outs), default=0.0)
    queue_s = (job.ticket.queue_seconds if job.ticket is not None else 0.0) + engine_queue
    total_s = (time.monotonic_ns() - t0_ns) / 1e9
    state.triton.record_success(
        t0_ns, len(job.handles), queue_s, max(total_s - queue_s, 0.0), 0 if job.ticket is not None else 1
    )


async def submit(
    state: ServerState, rows: list[LLMRequest], stream: bool, priority: int = 0, timeout_us: int | None = None
) -> Job:
    """Tokenizes and checks the rows, waits for the model's dynamic batcher (if it has one) and
    submits them to the engine (one engine request per row)."""
    state.check_serving()
    prompts = []
    params = []
    for r in rows:
        if state.tokenizer is None:
            raise KServeError(400, "input 'text_input': this model has no tokenizer files")
        ids = await state.tokenize(r.text)
        params.append(state.check_fit(ids, r.params, True, "text_input", "max_tokens"))
        prompts.append(ids)
    if state.batcher is None:
        if priority:
            raise KServeError(
                400,
                "parameter 'priority' needs priority_levels in the model's dynamic_batching",
            )
        return state.submit(prompts, params, stream, "text_input")
    policy = state.batcher.policy
    ticket = await state.batcher.acquire(len(rows), priority, timeout_us)
    try:
        job = state.submit(
            prompts, params, stream, "text_input", priority=policy.engine_priority(ticket.level)
        )
    except BaseException:
        state.batcher.release(ticket)
        raise
    job.ticket = ticket
    return job


async def _results(request: Request, job: Job) -> list:
    try:
        outs = await _gather_unless_disconnected(request, job.handles)
        if outs is None:
            raise KServeError(499, "the client disconnected")
        for i, out in enumerate(outs):
            job.observe(i, out)
    finally:
        job.close()
    return outs


# ---------------------------------------------------------------------------------------------- routes


@kserve_route
async def health_live(request: Request):
    return Response(status_code=200)


@kserve_route
async def health_ready(request: Request):
    return Response(status_code=200 if server_ready(_models(request)) else 400)


@kserve_route
async def server_metadata(request: Request):
    return {"name": "inflight", "version": _models(request).version, "extensions": EXTENSIONS}


def _metadata(model: str) -> dict:
    return {
        "name": model,
        "versions": [MODEL_VERSION],
        "platform": "inflight",
        "inputs": [{"name": n, "datatype": dt, "shape": [-1, *dims]} for n, dt, dims, _ in INPUTS],
        "outputs": [{"name": n, "datatype": dt, "shape": [-1, *dims]} for n, dt, dims in OUTPUTS],
    }


@kserve_route
async def model_metadata(request: Request, model: str, version: str | None = None):
    model_state(_models(request), model, version)
    return _metadata(model)


@kserve_route
async def get_model_ready(request: Request, model: str, version: str | None = None):
    try:
        state = model_state(_models(request), model, version)
    except KServeError:
        return Response(status_code=400)
    return Response(status_code=200 if model_ready(state) else 400)


def model_config(state: ServerState, model: str) -> dict:
    """The model's configuration in Triton's JSON form (ModelConfig): the interface, the engine's
    limits, and the dynamic batching it was configured with."""
    llm = state.llm

    def tensor(name: str, dt: str, dims: list[int], optional: bool | None) -> dict:
        out = {"name": name, "data_type": _TRITON_TYPE[dt], "dims": dims}
        if optional is not None:
            out["optional"] = optional
        return out

    config = {
        "name": model,
        "platform": "",
        "backend": "inflight",
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": llm.args.max_batch_size,
        "input": [tensor(n, dt, dims, opt) for n, dt, dims, opt in INPUTS],
        "output": [tensor(n, dt, dims, None) for n, dt, dims in OUTPUTS],
        "model_transaction_policy": {"decoupled": True},
        "parameters": {
            "max_seq_len": {"string_value": str(llm.max_seq_len)},
            "max_num_tokens": {"string_value": str(llm.args.max_num_tokens)},
            "vocab_size": {"string_value": str(llm.model_config.vocab_size)},
        },
    }
    if state.batcher is not None:
        p = state.batcher.policy
        config["dynamic_batching"] = {
            "preferred_batch_size": list(p.preferred_batch_sizes),
            "max_queue_delay_microseconds": p.max_queue_delay_us,
            "priority_levels": p.priority_levels,
            "default_priority_level": p.default_priority_level,
            "default_queue_policy": {
                "timeout_action": p.default_queue_policy.timeout_action,
                "default_timeout_microseconds": p.default_queue_policy.default_timeout_us,
                "allow_timeout_override": p.default_queue_policy.allow_timeout_override,
                "max_queue_size": p.default_queue_policy.max_queue_size,
            },
        }
    return config


@kserve_route
async def get_model_config(request: Request, model: str, version: str | None = None):
    return model_config(model_state(_models(request), model, version), model)


def _serving(state: ServerState, model: str) -> None:
    if not model_ready(state):
        raise KServeError(
            503,
            f"model '{model}' is not ready: the server is shutting down, the model is unloading or its engine stopped",
        )


@kserve_route
async def infer(request: Request, model: str, version: str | None = None):
    state = model_state(_models(request), model, version)
    t0 = time.monotonic_ns()
    try:
        return await _infer(request, state, model, t0)
    except (KServeError, APIError, BatcherError) as exc:
        state.triton.record_failure(t0, failure_reason(exc.status))
        raise
    except TensorError:
        state.triton.record_failure(t0, "OTHER")
        raise


async def _infer(request: Request, state: ServerState, model: str, t0: int):
    _serving(state, model)
    head, tensors = decode_request(await request.body(), request.headers.get(HEADER_LENGTH))
    _check_types(head["inputs"])
    rows = [llm_request(r, state.tokenizer) for r in rows_of(tensors)]
    if any(r.stream for r in rows):
        raise KServeError(
            400, "input 'stream': streaming needs gRPC ModelStreamInfer or the generate_stream route"
        )
    wanted = head.get("outputs")
    known = {n for n, _, _ in OUTPUTS}
    for o in wanted or []:  # before anything runs
        if not isinstance(o, dict) or o.get("name") not in known:
            name = o.get("name") if isinstance(o, dict) else o
            raise KServeError(400, f"unexpected inference output '{name}' for model '{model}'")
    priority, timeout = schedule_parameters(head.get("parameters") or {})
    job = await submit(state, rows, False, priority, timeout)
    outs = await _results(request, job)
    values = _outputs(rows, outs)
    record_success(state, job, t0, outs)
    binary_default = bool((head.get("parameters") or {}).get("binary_data_output", False))
    names = [o["name"] for o in wanted] if wanted else [n for n, _, _ in OUTPUTS]
    binary = set()
    for o in wanted or []:
        if (o.get("parameters") or {}).get("binary_data", binary_default):
            binary.add(o["name"])
    if not wanted and binary_default:
        binary = set(names)
    types = {n: dt for n, dt, _ in OUTPUTS}
    reply = {"model_name": model, "model_version": MODEL_VERSION}
    if "id" in head:
        reply["id"] = head["id"]
    body, json_len = encode_response(reply, [(n, types[n], values[n]) for n in names], binary)
    headers = {HEADER_LENGTH: str(json_len)} if json_len is not None else None
    media = "application/octet-stream" if json_len is not None else "application/json"
    return Response(body, media_type=media, headers=headers)


# -- the generate extension


async def _generate_fields(request: Request) -> tuple[dict[str, Any], int, int | None]:
    """The request's input fields, and its ``priority`` and ``timeout``."""
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise KServeError(400, f"failed to parse the request JSON: {exc}") from None
    if not isinstance(body, dict):
        raise KServeError(400, "the generate request must be a JSON object")
    fields = {k: v for k, v in body.items() if k not in ("parameters", "id")}
    params = body.get("parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise KServeError(400, "'parameters' must be a JSON object")
        for k, v in params.items():
            if k in fields:
                raise KServeError(400, f"'{k}' is given both at the top level and in 'parameters'")
            fields[k] = v
    schedule = {k: fields.pop(k) for k in ("priority", "timeout") if k in fields}
    return (fields, *schedule_parameters(schedule))


@kserve_route
async def generate(request: Request, model: str, version: str | None = None):
    state = model_state(_models(request), model, version)
    t0 = time.monotonic_ns()
    try:
        _serving(state, model)
        fields, priority, timeout = await _generate_fields(request)
        row = llm_request(fields, state.tokenizer)
        job = await submit(state, [row], False, priority, timeout)
        (out,) = await _results(request, job)
        values = _outputs([row], [out])
    except (KServeError, APIError, BatcherError) as exc:
        state.triton.record_failure(t0, failure_reason(exc.status))
        raise
    record_success(state, job, t0, [out])
    reply: dict[str, Any] = {"model_name": model, "model_version": MODEL_VERSION}
    texts = [t.decode() for t in values["text_output"][0]]
    reply["text_output"] = texts[0] if len(texts) == 1 else texts
    if row.return_log_probs:
        reply["cum_log_probs"] = values["cum_log_probs"][0].tolist()
        reply["output_log_probs"] = values["output_log_probs"][0].tolist()
    return reply


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


@kserve_route
async def generate_stream(request: Request, model: str, version: str | None = None):
    state = model_state(_models(request), model, version)
    t0 = time.monotonic_ns()
    try:
        _serving(state, model)
        fields, priority, timeout = await _generate_fields(request)
        row = llm_request(fields, state.tokenizer)
        if row.params.use_beam_search:
            raise KServeError(400, "input 'beam_width': beam search cannot stream")
        job = await submit(state, [row], True, priority, timeout)
    except (KServeError, APIError, BatcherError) as exc:
        state.triton.record_failure(t0, failure_reason(exc.status))
        raise

    async def events():
        last = None
        try:
            async for out in job.handles[0]:
                job.observe(0, out)
                last = out
                comp = out.outputs[0]
                if (err := _failure(comp)) is not None:
                    state.triton.record_failure(t0, failure_reason(err.status))
                    yield _sse({"error": err.message})
                    return
                if not comp.text_diff and not out.finished:
                    continue
                event: dict[str, Any] = {
                    "model_name": model,
                    "model_version": MODEL_VERSION,
                    "text_output": comp.text_diff,
                }
                if row.return_log_probs:
                    new = (
                        comp.logprobs[len(comp.logprobs) - len(comp.token_ids_diff) :]
                        if comp.logprobs
                        else []
                    )
                    event["output_log_probs"] = [e[t] for t, e in zip(comp.token_ids_diff, new)]
                    event["cum_log_probs"] = comp.cumulative_logprob or 0.0
                yield _sse(event)
            if last is not None:
                record_success(state, job, t0, [last])
        except Exception as exc:  # noqa: BLE001  (an engine error after the first event: an error event)
            state.triton.record_failure(t0, "BACKEND")
            yield _sse({"error": f"{type(exc).__name__}: {exc}"})

    return SSEResponse(events(), job)  # closes the job (aborting what still runs) whatever happens


# -- the model repository extension


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise KServeError(400, f"failed to parse the request JSON: {exc}") from None
    if not isinstance(body, dict):
        raise KServeError(400, "the request body must be a JSON object")
    return body


@kserve_route
async def repository_index(request: Request):
    body = await _json_body(request)
    ready = bool(body.get("ready", False))
    return JSONResponse([e for e in _models(request).index() if not ready or e["state"] == "READY"])


@kserve_route
async def repository_load(request: Request, model: str):
    body = await _json_body(request)
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise KServeError(400, "'parameters' must be a JSON object")
    config = params.get("config")
    if config is not None and not isinstance(config, str):
        raise KServeError(400, "parameter 'config' must be a string holding the model configuration as JSON")
    if any(k.startswith("file:") for k in params):
        raise KServeError(
            400, "loading a model from files sent with the request is not supported ('file:' parameters)"
        )
    await _models(request).load(model, config)
    return Response(status_code=200)


@kserve_route
async def repository_unload(request: Request, model: str):
    await _json_body(request)
    await _models(request).unload(model)
    return Response(status_code=200)


@kserve_route
async def model_statistics(request: Request, model: str | None = None, version: str | None = None):
    models = _models(request)
    states = [model_state(models, model, version)] if model is not None else models.serving()
    return {"model_stats": [statistics(s) for s in states]}


def statistics(state: ServerState) -> dict:
    """One model's statistics in Triton's JSON form."""
    s = state.triton.snapshot()
    return {
        "name": state.model_name,
        "version": MODEL_VERSION,
        "last_inference": s["last_inference_ms"],
        "inference_count": s["inference_count"],
        "execution_count": s["execution_count"],
        "inference_stats": {
            "success": {"count": s["success"], "ns": s["success_ns"]},
            "fail": {"count": sum(s["failure"].values()), "ns": s["fail_ns"]},
            "queue": {"count": s["success"], "ns": s["queue_ns"]},
            "compute_infer": {"count": s["success"], "ns": s["compute_ns"]},
        },
    }


_M = "/v2/models/{model}"
_MV = "/v2/models/{model}/versions/{version}"
ROUTES = (
    ("GET", "/v2/health/live", health_live),
    ("GET", "/v2/health/ready", health_ready),
    ("GET", "/v2", server_metadata),
    ("GET", "/v2/models/stats", model_statistics),  # before /v2/models/{model}
    *(("GET", p, model_metadata) for p in (_M, _MV)),
    *(("GET", p + "/ready", get_model_ready) for p in (_M, _MV)),
    *(("GET", p + "/stats", model_statistics) for p in (_M, _MV)),
    ("POST", "/v2/repository/index", repository_index),
    ("POST", "/v2/repository/models/{model}/load", repository_load),
    ("POST", "/v2/repository/models/{model}/unload", repository_unload),
    *(("GET", p + "/config", get_model_config) for p in (_M, _MV)),
    *(("POST", p + "/infer", infer) for p in (_M, _MV)),
    *(("POST", p + "/generate", generate) for p in (_M, _MV)),
    *(("POST", p + "/generate_stream", generate_stream) for p in (_M, _MV)),
)
