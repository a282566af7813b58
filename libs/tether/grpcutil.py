"""gRPC plumbing shared by every service: the server (health, reflection, error mapping,
service-credential check) and client channels that present the service credential."""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tether.errors import CODE_METADATA_KEY, InvalidArgument, TetherError

log = logging.getLogger(__name__)

SERVICE_TOKEN_KEY = "x-tether-service-token"
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

Handler = Callable[[Any, grpc.aio.ServicerContext], Any]


async def _abort(context: grpc.aio.ServicerContext, exc: TetherError) -> None:
    context.set_trailing_metadata(((CODE_METADATA_KEY, exc.code),))
    await context.abort(exc.status, exc.message)


class Undecodable:
    """A request whose bytes did not decode; the handler's wrapper refuses it as the caller's
    mistake (grpc would answer UNKNOWN for an exception raised while deserializing)."""

    def __init__(self, error: InvalidArgument) -> None:
        self.error = error


def tolerant_deserializer(
    deserialize: Callable[[bytes], Any] | None,
) -> Callable[[bytes], Any] | None:
    """`deserialize`, returning an `Undecodable` instead of raising on malformed bytes
    (invalid UTF-8 in a string field, a truncated message)."""
    if deserialize is None:
        return None

    def decode(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except DecodeError as exc:
            # upb's message names the type and the problem ("String field had bad UTF-8").
            detail = str(exc).replace("Error parsing message with type", "could not decode")
            return Undecodable(
                InvalidArgument(
                    f"the request is not valid protobuf: {detail}; every string field must be "
                    "valid UTF-8",
                    code="undecodable_request",
                )
            )

    return decode


def _refuse_undecodable(request: Any) -> None:
    if isinstance(request, Undecodable):
        raise request.error


def _wrap_unary(behavior: Handler) -> Handler:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            _refuse_undecodable(request)
            return await behavior(request, context)
        except TetherError as exc:
            await _abort(context, exc)
        except Exception:
            if context.code() not in (None, grpc.StatusCode.OK):
                raise  # context.abort() already chose the status
            log.exception("unhandled error in %s", getattr(behavior, "__qualname__", behavior))
            # Never leak internals (SQL, stack frames) to a caller; the log has the detail.
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the service log")

    return wrapper


def _wrap_stream(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            _refuse_undecodable(request)
            async for item in behavior(request, context):
                yield item
        except TetherError as exc:
            await _abort(context, exc)

    return wrapper


class ErrorInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no stubs
    """Maps TetherError to its gRPC status, with the stable code in trailing metadata; a request
    that does not decode is INVALID_ARGUMENT (`tolerant_deserializer`)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return None
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary),
                request_deserializer=tolerant_deserializer(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream),
                request_deserializer=tolerant_deserializer(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return handler


class ServiceTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Admits only callers presenting the platform's shared service credential.

    Health and reflection stay open so probes work; everything else of an internal service is
    reachable only from inside the platform.
    """

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(_OPEN_PREFIXES):
            return await continuation(details)
        presented = dict(details.invocation_metadata or ()).get(SERVICE_TOKEN_KEY, "")
        if isinstance(presented, str) and hmac.compare_digest(presented.encode(), self._token):
            return await continuation(details)

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "internal service: calls must present the platform service credential",
            )

        return grpc.unary_unary_rpc_method_handler(refuse)


async def start_server(
    *,
    host: str,
    port: int,
    register: Sequence[Callable[[grpc.aio.Server], None]],
    service_names: Sequence[str],
    service_token: str | None,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Start a gRPC server with health checking, reflection and error mapping.

    `register` adds the service's servicers; `service_token`, when set, requires the platform
    credential on every call but health and reflection. Returns the server, the bound port and
    the health servicer (already SERVING).
    """
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if service_token:
        interceptors.append(ServiceTokenInterceptor(service_token))
    interceptors.append(ErrorInterceptor())
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 32 << 20)],
    )
    for add in register:
        add(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [
            *service_names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    for name in ("", *service_names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


class _TokenClientInterceptor(
    grpc.aio.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.aio.UnaryStreamClientInterceptor,  # type: ignore[misc]
):
    def __init__(self, token: str) -> None:
        self._pair = (SERVICE_TOKEN_KEY, token)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(*self._pair)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


def internal_channel(address: str, service_token: str | None) -> grpc.aio.Channel:
    """A channel to another Tether service, presenting the service credential when set."""
    interceptors = [_TokenClientInterceptor(service_token)] if service_token else None
    return grpc.aio.insecure_channel(
        address,
        interceptors=interceptors,
        options=[("grpc.max_receive_message_length", 32 << 20)],
    )
