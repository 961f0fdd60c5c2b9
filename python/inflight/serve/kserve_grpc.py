"""Triton's gRPC API (KServe v2 over gRPC), on the HTTP server's event loop and port ``--grpc-port``.

The servicer implements the ``GRPCInferenceService`` whose generated code ships in the tritonclient
wheel (``tritonclient.grpc.service_pb2`` / ``service_pb2_grpc``; no protos copied or compiled here):
ServerLive / ServerReady / ModelReady, ServerMetadata, ModelMetadata, ModelConfig, ModelInfer,
ModelStreamInfer (decoupled: a request with ``stream`` true gets one response per new piece of text,
the last one flagged ``triton_final_response``; an error for one request arrives on the stream as its
``error_message`` and the stream stays open), ModelStatistics and the repository RPCs (this server
serves the one model it started with: the index lists it, load and unload are refused). The rest
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

from inflight.serve.kserve import (
    EXTENSIONS,
    INPUTS,
    MODEL_VERSION,
    OUTPUTS,
    KServeError,
    LLMRequest,
    _check_types,
    _failure,
    _outputs,
    _ready,
    check_model,
    llm_request,
    model_config,
    rows_of,
    submit,
)
from inflight.serve.kserve_tensors import DTYPES, TensorError, deserialize_bytes, serialize_bytes
from inflight.serve.protocol import APIError

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
    if isinstance(exc, KServeError):
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


class KServeStats:
    """Counts for ModelStatistics: requests that succeeded / failed (with their durations), rows
    inferred, engine submissions."""

    def __init__(self) -> None:
        self.success = [0, 0]  # count, ns
        self.fail = [0, 0]
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0

    def record(self, ok: bool, t0: int, rows: int = 0) -> None:
        dt = time.monotonic_ns() - t0
        slot = self.success if ok else self.fail
        slot[0] += 1
        slot[1] += dt
        if ok:
            self.inference_count += rows
            self.execution_count += 1
        self.last_inference_ms = int(time.time() * 1000)


class InferenceServicer(pbg.GRPCInferenceServiceServicer):
    def __init__(self, state) -> None:
        self.state = state
        self.stats = KServeStats()

    async def _fail(self, context, exc: Exception):
        code, message = _status(exc)
        await context.abort(code, message)

    # -- probes and metadata
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=_ready(self.state))

    async def ModelReady(self, request, context):
        try:
            check_model(self.state, request.name, request.version or None)
        except KServeError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=_ready(self.state))

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="inflight", version=self.state.version, extensions=EXTENSIONS)

    async def ModelMetadata(self, request, context):
        try:
            check_model(self.state, request.name, request.version or None)
        except KServeError as exc:
            await self._fail(context, exc)
        resp = pb.ModelMetadataResponse(name=request.name, versions=[MODEL_VERSION], platform="inflight")
        for name, dt, dims, _ in INPUTS:
            resp.inputs.add(name=name, datatype=dt, shape=[-1, *dims])
        for name, dt, dims in OUTPUTS:
            resp.outputs.add(name=name, datatype=dt, shape=[-1, *dims])
        return resp

    async def ModelConfig(self, request, context):
        try:
            check_model(self.state, request.name, request.version or None)
        except KServeError as exc:
            await self._fail(context, exc)
        config = json_format.ParseDict(model_config(self.state, request.name), model_config_pb2.ModelConfig())
        return pb.ModelConfigResponse(config=config)

    async def ModelStatistics(self, request, context):
        if request.name:
            try:
                check_model(self.state, request.name, request.version or None)
            except KServeError as exc:
                await self._fail(context, exc)
        s = self.stats
        stat = pb.ModelStatistics(
            name=request.name or self.state.model_name,
            version=MODEL_VERSION,
            last_inference=s.last_inference_ms,
            inference_count=s.inference_count,
            execution_count=s.execution_count,
        )
        stat.inference_stats.success.count, stat.inference_stats.success.ns = s.success
        stat.inference_stats.fail.count, stat.inference_stats.fail.ns = s.fail
        return pb.ModelStatisticsResponse(model_stats=[stat])

    async def RepositoryIndex(self, request, context):
        resp = pb.RepositoryIndexResponse()
        for name in self.state.model_names:
            resp.models.add(
                name=name, version=MODEL_VERSION, state="READY" if _ready(self.state) else "UNAVAILABLE"
            )
        return resp

    async def RepositoryModelLoad(self, request, context):
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"explicit model load is not allowed: this server serves only '{self.state.model_name}'",
        )

    async def RepositoryModelUnload(self, request, context):
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"explicit model unload is not allowed: this server serves only '{self.state.model_name}'",
        )

    # -- inference
    def _rows(self, request) -> list[LLMRequest]:
        check_model(self.state, request.model_name, request.model_version or None)
        _check_types([{"name": i.name, "datatype": i.datatype} for i in request.inputs])
        return [llm_request(r, self.state.tokenizer) for r in rows_of(request_tensors(request))]

    async def ModelInfer(self, request, context):
        t0 = time.monotonic_ns()
        job = None
        try:
            rows = self._rows(request)
            if any(r.stream for r in rows):
                raise KServeError(400, "input 'stream': streaming needs ModelStreamInfer")
            job = await submit(self.state, rows, False)
            outs = await asyncio.gather(*job.handles)
            for i, out in enumerate(outs):
                job.observe(i, out)
            resp = infer_response(request, request.model_name, _outputs(rows, outs))
        except (KServeError, TensorError, APIError) as exc:
            self.stats.record(False, t0)
            await self._fail(context, exc)
        finally:
            if job is not None:
                job.close()
        self.stats.record(True, t0, len(rows))
        return resp

    async def ModelStreamInfer(self, request_iterator, context):
        """Each request of the stream runs on its own; their responses interleave as they come."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()

        async def one(request) -> None:
            t0 = time.monotonic_ns()
            job = None
            try:
                rows = self._rows(request)
                empty_final = (
                    request.parameters["triton_enable_empty_final_response"].bool_param
                    if ("triton_enable_empty_final_response" in request.parameters)
                    else False
                )
                if any(r.stream for r in rows):
                    if len(rows) != 1:
                        raise KServeError(400, "input 'stream': a streamed request has one row")
                    if rows[0].params.use_beam_search:
                        raise KServeError(400, "input 'beam_width': beam search cannot stream")
                    job = await submit(self.state, rows, True)
                    async for out in job.handles[0]:
                        job.observe(0, out)
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
                else:
                    job = await submit(self.state, rows, False)
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
                self.stats.record(True, t0, 1)
            except (KServeError, TensorError, APIError) as exc:
                self.stats.record(False, t0)
                queue.put_nowait(pb.ModelStreamInferResponse(error_message=_status(exc)[1]))
            except Exception as exc:  # noqa: BLE001  (one request's failure stays on its own)
                self.stats.record(False, t0)
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


async def start_grpc(state, host: str, port: int):
    """Starts the gRPC server on the running event loop; returns (server, bound port)."""
    server = grpc.aio.server()
    pbg.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(state), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind the gRPC port {host}:{port}")
    await server.start()
    return server, bound
