"""The gRPC side: ``inference.GRPCInferenceService`` (Triton's grpc_service.proto) on ``grpc.aio``.

It runs in the REST server's event loop, on the same :class:`OipService`, so
one batcher per model serves both protocols. Inputs come as
``raw_input_contents`` (what tritonclient sends) or typed ``contents``;
outputs go back as ``raw_output_contents``, as Triton sends them. The API key
travels as ``authorization: Bearer KEY`` metadata (tritonclient's ``headers=``);
ServerLive and ServerReady need none. RPCs outside the served subset (streaming,
model control, shared memory, trace and log settings) answer UNIMPLEMENTED.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf import json_format

from dspark.server.limits import bearer_ok
from dspark.server.oip import datatypes
from dspark.server.oip.errors import OipError, bad_request
from dspark.server.oip.model import ServedModel
from dspark.server.oip.protos import grpc_service_pb2, grpc_service_pb2_grpc
from dspark.server.oip.service import OipService

T = TypeVar("T")
pb: Any = grpc_service_pb2  # generated, untyped: its messages are built at import time
pb_grpc: Any = grpc_service_pb2_grpc

_UNSUPPORTED = {
    "ModelStreamInfer": "streaming inference", "RepositoryModelLoad": "model control (load)",
    "RepositoryModelUnload": "model control (unload)", "SystemSharedMemoryStatus": "system shared memory",
    "SystemSharedMemoryRegister": "system shared memory", "SystemSharedMemoryUnregister": "system shared memory",
    "CudaSharedMemoryStatus": "CUDA shared memory", "CudaSharedMemoryRegister": "CUDA shared memory",
    "CudaSharedMemoryUnregister": "CUDA shared memory", "TraceSetting": "trace settings",
    "LogSettings": "log settings",
}


def decode_infer(model: ServedModel, request: Any) -> tuple[dict[str, np.ndarray], list[str]]:
    """A ModelInferRequest's inputs as arrays, and the outputs it asks for (all when it names none)."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise bad_request(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs: use it for "
                          "every input or for none")
    feed: dict[str, np.ndarray] = {}
    for i, inp in enumerate(request.inputs):
        if inp.name in feed:
            raise bad_request(f"input '{inp.name}' is given twice")
        if any(k.startswith("shared_memory") for k in inp.parameters):
            raise bad_request(f"input '{inp.name}': shared memory is not supported by this server")
        shape = list(inp.shape)
        model.check_input(inp.name, inp.datatype, shape)
        where = f"input '{inp.name}'"
        if raw:
            feed[inp.name] = datatypes.from_raw(raw[i], inp.datatype, shape, where)
        else:
            feed[inp.name] = datatypes.from_contents(inp.contents, inp.datatype, shape, where)
    for out in request.outputs:
        if "classification" in out.parameters:
            raise bad_request(f"output '{out.name}': the classification extension is not supported")
        if any(k.startswith("shared_memory") for k in out.parameters):
            raise bad_request(f"output '{out.name}': shared memory is not supported by this server")
    names = [o.name for o in request.outputs] or [t.name for t in model.outputs]
    model.check_outputs(names)
    return feed, names


def encode_infer(model: ServedModel, request: Any, names: list[str], outs: dict[str, np.ndarray]) -> Any:
    types = {t.name: t.datatype for t in model.outputs}
    resp = pb.ModelInferResponse(model_name=model.name, model_version=model.version, id=request.id)
    for name in names:
        arr = outs[name]
        resp.outputs.add(name=name, datatype=types[name], shape=list(arr.shape))
        resp.raw_output_contents.append(datatypes.to_raw(arr, types[name]))
    return resp


class OipServicer(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, service: OipService) -> None:
        self.service = service

    async def _answer(self, context: Any, fn: Callable[[], Awaitable[T] | T], *, open_: bool = False) -> T:
        """Run ``fn`` after the API key check; an :class:`OipError` becomes the call's status."""
        try:
            if not open_ and self.service.api_key is not None:
                auth = next((v for k, v in context.invocation_metadata() if k == "authorization"), None)
                if not bearer_ok(auth, self.service.api_key):
                    raise OipError(401, "incorrect or missing API key (send 'authorization: Bearer KEY' metadata)")
            result = fn()
            return await result if isinstance(result, Awaitable) else result
        except OipError as e:
            await context.abort(e.grpc_code, e.message)
            raise  # abort raises; this only tells the type checker

    async def ServerLive(self, request: Any, context: Any) -> Any:  # noqa: N802 (the proto's names)
        return await self._answer(context, lambda: pb.ServerLiveResponse(live=self.service.live), open_=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await self._answer(context, lambda: pb.ServerReadyResponse(ready=self.service.ready), open_=True)

    async def ModelReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await self._answer(context, lambda: pb.ModelReadyResponse(
            ready=self.service.model_ready(request.name, request.version)))

    async def ServerMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await self._answer(context, lambda: pb.ServerMetadataResponse(**self.service.server_metadata()))

    async def ModelMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        def meta() -> Any:
            md = self.service.model(request.name, request.version).metadata()
            return pb.ModelMetadataResponse(
                name=md["name"], versions=md["versions"], platform=md["platform"],
                inputs=[pb.ModelMetadataResponse.TensorMetadata(**t) for t in md["inputs"]],
                outputs=[pb.ModelMetadataResponse.TensorMetadata(**t) for t in md["outputs"]])
        return await self._answer(context, meta)

    async def ModelConfig(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await self._answer(context, lambda: pb.ModelConfigResponse(
            config=self.service.model(request.name, request.version).config()))

    async def ModelStatistics(self, request: Any, context: Any) -> Any:  # noqa: N802
        def stats() -> Any:
            snaps = self.service.statistics(request.name, request.version)
            return pb.ModelStatisticsResponse(model_stats=[json_format.ParseDict(s, pb.ModelStatistics())
                                                           for s in snaps])
        return await self._answer(context, stats)

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await self._answer(context, lambda: pb.RepositoryIndexResponse(models=[
            pb.RepositoryIndexResponse.ModelIndex(**m) for m in self.service.repository_index()
            if not request.ready or m["state"] == "READY"]))

    async def ModelInfer(self, request: Any, context: Any) -> Any:  # noqa: N802
        async def infer() -> Any:
            t0 = time.monotonic_ns()
            model = self.service.model(request.model_name, request.model_version)
            try:
                feed, names = decode_infer(model, request)
                outs = await self.service.infer(model, feed)
                resp = encode_infer(model, request, names, outs)
            except OipError as e:
                self.service.finished(model, t0, e)
                raise
            self.service.finished(model, t0)
            return resp
        return await self._answer(context, infer)


def _unsupported(what: str) -> Callable[..., Awaitable[Any]]:
    async def rpc(self: OipServicer, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{what} is not supported by this server")
    return rpc


for _name, _what in _UNSUPPORTED.items():
    setattr(OipServicer, _name, _unsupported(_what))


async def start_grpc(service: OipService, host: str, port: int, max_message_bytes: int | None) -> tuple[Any, int]:
    """Bind and start the gRPC server in the running loop: ``(server, bound port)``."""
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", max_message_bytes or -1), ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", 0),  # a port already taken is an error, not a second listener beside it
    ])
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(OipServicer(service), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as e:
        raise OSError(f"server.grpc_port: cannot listen on {address}: {e}") from None
    if not bound:
        raise OSError(f"server.grpc_port: cannot listen on {address}")
    await server.start()
    return server, bound
