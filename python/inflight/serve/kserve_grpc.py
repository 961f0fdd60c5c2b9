"""Triton's gRPC API (KServe v2 over gRPC), on the HTTP server's event loop and port ``--grpc-port``.

The servicer implements the ``GRPCInferenceService`` whose generated code ships in the tritonclient
wheel (``tritonclient.grpc.service_pb2`` / ``service_pb2_grpc``; no protos copied or compiled here):
ServerLive / ServerReady / ModelReady, ServerMetadata, ModelMetadata, ModelConfig, ModelInfer,
ModelStreamInfer (decoupled: a request with ``stream`` true gets one response per new piece of text,
the last one flagged ``triton_final_response``; an error for one request arrives on the stream as its
``error_message`` and the stream stays open), ModelStatistics and the repository RPCs (index, load,
unload: those of the served :class:`~inflight.serve.state.ModelSet`; a server of one model refuses
load and unload). The rest
answers UNIMPLEMENTED (the base class). Requests go through the same interface as the HTTP routes
(:mod:`inflight.serve.kserve`), so both give the same text.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pbg

from inflight.serve.batcher import BatcherError
from inflight.serve.kserve import (
    EXTENSIONS,
    failure_reason,
    model_config,
    model_ready,
    model_state,
    record_success,
    server_ready,
    statistics,
    submit,
)
from inflight.serve.kserve_llm import (
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
from inflight.serve.kserve_tensors import DTYPES, TensorError, deserialize_bytes, serialize_bytes
from inflight.serve.protocol import APIError
from inflight.serve.state import MODEL_VERSION

logger = logging.getLogger("inflight.serve")

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    503: grpc.StatusCode.UNAVAILABLE,
}
# InferTensorContents field by datatype.
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def _status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, (KServeError, BatcherError)):
        return _CODES.get(exc.status, grpc.StatusCode.INTERNAL), exc.message
    if isinstance(exc, APIError):
        return _CODES.get(exc.status, grpc.StatusCode.INTERNAL), exc.message
    return grpc.StatusCode.INVALID_ARGUMENT, str(exc)


def request_tensors(req: pb.ModelInferRequest) -> dict[str, np.ndarray]:
    """The request's inputs as numpy arrays: from ``raw_input_contents`` (as the binary extension) or
    from each input's typed ``contents``."""
    raw = list(req.raw_input_contents)
    if raw and len(raw) != len(req.inputs):
        raise TensorError(f"{len(raw)} raw input contents for {len(req.inputs)} inputs")
    out: dict[str, np.ndarray] = {}
    for i, inp in enumerate(req.inputs):
        if inp.datatype not in DTYPES:
            raise TensorError(f"input '{inp.name}': unknown datatype {inp.datatype!r}")
        shape = tuple(int(d) for d in inp.shape)
        count = math.prod(shape)
        if raw:
            if inp.datatype == "BYTES":
                arr = deserialize_bytes(raw[i], count, inp.name)
            else:
                dtype = np.dtype(DTYPES[inp.datatype]).newbyteorder("<")
                if len(raw[i]) != count * dtype.itemsize:
                    raise TensorError(
                        f"input '{inp.name}': {len(raw[i])} raw bytes for shape {list(shape)} of {inp.datatype}"
                    )
                arr = np.frombuffer(raw[i], dtype=dtype).copy()
        else:
            values = list(getattr(inp.contents, _CONTENTS[inp.datatype]))
            if len(values) != count:
                raise TensorError(
                    f"input '{inp.name}': shape {list(shape)} holds {count} elements, but {len(values)} were given"
                )
            arr = (
                np.array(values, dtype=DTYPES[inp.datatype])
                if inp.datatype != "BYTES"
                else np.array(values, dtype=np.object_)
            )
        if inp.name in out:
            raise TensorError(f"input '{inp.name}' is given twice")
        out[inp.name] = arr.reshape(shape)
    return out


def infer_response(
    req: pb.ModelInferRequest, model: str, values: dict[str, np.ndarray], final: bool | None = None
):
    """A ModelInferResponse with the requested outputs (all, when none is named) as raw contents."""
    names = [o.name for o in req.outputs] or [n for n, _, _ in OUTPUTS]
    types = {n: dt for n, dt, _ in OUTPUTS}
    resp = pb.ModelInferResponse(model_name=model, model_version=MODEL_VERSION, id=req.id)
    for name in names:
        if name not in values:
            raise KServeError(400, f"unexpected inference output '{name}' for model '{model}'")
        arr = values[name]
        resp.outputs.add(name=name, datatype=types[name], shape=list(arr.shape))
        raw = (
            serialize_bytes(arr)
            if types[name] == "BYTES"
            else np.ascontiguousarray(arr, arr.dtype.newbyteorder("<")).tobytes()
        )
        resp.raw_output_contents.append(raw)
    if final is not None:
        resp.parameters["triton_final_response"].bool_param = final
    return resp


def _schedule(request) -> tuple[int, int | None]:
    """The request's ``priority`` and ``timeout`` parameters (tritonclient sets uint64 / int64)."""
    values = {}
    for name in ("priority", "timeout"):
        if name in request.parameters:
            p = request.parameters[name]
            values[name] = getattr(p, p.WhichOneof("parameter_choice"))
    return schedule_parameters(values)


class InferenceServicer(pbg.GRPCInferenceServiceServicer):
    def __init__(self, models) -> None:
        self.models = models

    async def _fail(self, context, exc: Exception):
        code, message = _status(exc)
        await context.abort(code, message)

    async def _state(self, request, context, name: str, version: str):
        try:
            return model_state(self.models, name, version or None)
        except KServeError as exc:
            await self._fail(context, exc)

    # -- probes and metadata
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=server_ready(self.models))

    async def ModelReady(self, request, context):
        try:
            state = model_state(self.models, request.name, request.version or None)
        except KServeError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=model_ready(state))

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="inflight", version=self.models.version, extensions=EXTENSIONS)

    async def ModelMetadata(self, request, context):
        await self._state(request, context, request.name, request.version)
        resp = pb.ModelMetadataResponse(name=request.name, versions=[MODEL_VERSION], platform="inflight")
        for name, dt, dims, _ in INPUTS:
            resp.inputs.add(name=name, datatype=dt, shape=[-1, *dims])
        for name, dt, dims in OUTPUTS:
            resp.outputs.add(name=name, datatype=dt, shape=[-1, *dims])
        return resp

    async def ModelConfig(self, request, context):
        state = await self._state(request, context, request.name, request.version)
        config = json_format.ParseDict(model_config(state, request.name), model_config_pb2.ModelConfig())
        return pb.ModelConfigResponse(config=config)

    async def ModelStatistics(self, request, context):
        if request.name:
            states = [await self._state(request, context, request.name, request.version)]
        else:
            states = self.models.serving()
        resp = pb.ModelStatisticsResponse()
        for state in states:
            json_format.ParseDict(statistics(state), resp.model_stats.add())
        return resp

    async def RepositoryIndex(self, request, context):
        resp = pb.RepositoryIndexResponse()
        for entry in self.models.index():
            if request.ready and entry["state"] != "READY":
                continue
            resp.models.add(**entry)
        return resp

    async def RepositoryModelLoad(self, request, context):
        config = None
        for key, p in request.parameters.items():
            if key == "config":
                config = p.string_param
            elif key.startswith("file:"):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "loading a model from files sent with the request is not supported ('file:' parameters)",
                )
        try:
            await self.models.load(request.model_name, config)
        except (KServeError, APIError) as exc:
            await self._fail(context, exc)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        try:
            await self.models.unload(request.model_name)
        except (KServeError, APIError) as exc:
            await self._fail(context, exc)
        return pb.RepositoryModelUnloadResponse()

    # -- inference
    def _model(self, request):
        return model_state(self.models, request.model_name, request.model_version or None)

    def _rows(self, state, request) -> list[LLMRequest]:
        if not model_ready(state):
            raise KServeError(503, f"model '{request.model_name}' is not ready")
        _check_types([{"name": i.name, "datatype": i.datatype} for i in request.inputs])
        return [llm_request(r, state.tokenizer) for r in rows_of(request_tensors(request))]

    async def ModelInfer(self, request, context):
        t0 = time.monotonic_ns()
        job = state = None
        try:
            state = self._model(request)
            rows = self._rows(state, request)
            if any(r.stream for r in rows):
                raise KServeError(400, "input 'stream': streaming needs ModelStreamInfer")
            job = await submit(state, rows, False, *_schedule(request))
            outs = await asyncio.gather(*job.handles)
            for i, out in enumerate(outs):
                job.observe(i, out)
            resp = infer_response(request, request.model_name, _outputs(rows, outs))
            record_success(state, job, t0, outs)
        except (KServeError, TensorError, APIError, BatcherError) as exc:
            if state is not None:
                state.triton.record_failure(t0, failure_reason(getattr(exc, "status", 400)))
            await self._fail(context, exc)
        finally:
            if job is not None:
                job.close()
        return resp

    async def ModelStreamInfer(self, request_iterator, context):
        """Each request of the stream runs on its own; their responses interleave as they come."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()

        async def one(request) -> None:
            t0 = time.monotonic_ns()
            job = state = None
            try:
                state = self._model(request)
                rows = self._rows(state, request)
                empty_final = (
                    request.parameters["triton_enable_empty_final_response"].bool_param
                    if ("triton_enable_empty_final_response" in request.parameters)
                    else False
                )
                schedule = _schedule(request)
                if any(r.stream for r in rows):
                    if len(rows) != 1:
                        raise KServeError(400, "input 'stream': a streamed request has one row")
                    if rows[0].params.use_beam_search:
                        raise KServeError(400, "input 'beam_width': beam search cannot stream")
                    job = await submit(state, rows, True, *schedule)
                    last = None
                    async for out in job.handles[0]:
                        job.observe(0, out)
                        last = out
                        comp = out.outputs[0]
                        if (err := _failure(comp)) is not None:
                            raise err
                        if not comp.text_diff and not out.finished:
                            continue
                        values = _stream_values(rows[0], comp)
                        final = out.finished and not empty_final
                        queue.put_nowait(
                            pb.ModelStreamInferResponse(
                                infer_response=infer_response(request, request.model_name, values, final)
                            )
                        )
                    outs = [last] if last is not None else []
                else:
                    job = await submit(state, rows, False, *schedule)
                    outs = await asyncio.gather(*job.handles)
                    for i, out in enumerate(outs):
                        job.observe(i, out)
                    queue.put_nowait(
                        pb.ModelStreamInferResponse(
                            infer_response=infer_response(
                                request, request.model_name, _outputs(rows, outs), not empty_final
                            )
                        )
                    )
                if empty_final:
                    final = pb.ModelInferResponse(
                        model_name=request.model_name, model_version=MODEL_VERSION, id=request.id
                    )
                    final.parameters["triton_final_response"].bool_param = True
                    queue.put_nowait(pb.ModelStreamInferResponse(infer_response=final))
                record_success(state, job, t0, outs)
            except (KServeError, TensorError, APIError, BatcherError) as exc:
                if state is not None:
                    state.triton.record_failure(t0, failure_reason(getattr(exc, "status", 400)))
                queue.put_nowait(pb.ModelStreamInferResponse(error_message=_status(exc)[1]))
            except Exception as exc:  # noqa: BLE001  (one request's failure stays on its own)
                if state is not None:
                    state.triton.record_failure(t0, "BACKEND")
                queue.put_nowait(pb.ModelStreamInferResponse(error_message=f"{type(exc).__name__}: {exc}"))
            finally:
                if job is not None:
                    job.close()

        async def read() -> None:
            async for request in request_iterator:
                task = asyncio.ensure_future(one(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
            queue.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                yield item
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()


def _stream_values(row: LLMRequest, comp) -> dict[str, np.ndarray]:
    """One streamed response: the new text (and its tokens' log-probabilities)."""
    text = np.empty((1, 1), dtype=np.object_)
    text[0, 0] = comp.text_diff.encode()
    n = len(comp.token_ids_diff)
    lps = np.zeros((1, 1, n), dtype=np.float32)
    cum = np.zeros((1, 1), dtype=np.float32)
    if row.return_log_probs and comp.logprobs:
        new = comp.logprobs[len(comp.logprobs) - n :]
        lps[0, 0, :] = [e[t] for t, e in zip(comp.token_ids_diff, new)]
        cum[0, 0] = comp.cumulative_logprob or 0.0
    return {"text_output": text, "cum_log_probs": cum, "output_log_probs": lps}


async def start_grpc(models, host: str, port: int, max_message_bytes: int | None = None):
    """Starts the gRPC server for a :class:`~inflight.serve.state.ModelSet` on the running event loop;
    returns (server, bound port). ``max_message_bytes``: the largest request message (the HTTP
    API's body limit; None: no limit); a larger one fails with RESOURCE_EXHAUSTED."""
    limit = max_message_bytes if max_message_bytes is not None else -1
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit)])
    pbg.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(models), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind the gRPC port {host}:{port}")
    await server.start()
    return server, bound
