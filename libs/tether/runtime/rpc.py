"""gRPC plumbing shared by every service: the server (health, reflection, error mapping,
the caller check) and client channels that present the calling service's credential."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tether.credentials import CREDENTIAL_KEY, POWERS, verifier
from tether.errors import CODE_METADATA_KEY, InvalidArgument, TetherError, from_rpc_error

log = logging.getLogger(__name__)

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


@contextlib.asynccontextmanager
async def _answered(context: grpc.aio.ServicerContext, behavior: Any) -> AsyncIterator[None]:
    """A TetherError raised inside becomes its status (with the stable code); anything else is
    INTERNAL, its detail logged and never shown to the caller."""
    try:
        yield
    except TetherError as exc:
        await _abort(context, exc)
    except Exception:
        if context.code() not in (None, grpc.StatusCode.OK):
            raise  # context.abort() already chose the status
        log.exception("unhandled error in %s", getattr(behavior, "__qualname__", behavior))
        # Never leak internals (SQL, stack frames) to a caller; the log has the detail.
        await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the service log")


def _wrap_unary(behavior: Handler) -> Handler:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with _answered(context, behavior):
            _refuse_undecodable(request)
            return await behavior(request, context)

    return wrapper


def _wrap_stream(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """A server-streaming or a bidirectional handler (a bidirectional one's requests are an
    iterator, whose undecodable items its handler refuses as it reads them)."""

    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async with _answered(context, behavior):
            _refuse_undecodable(request)
            async for item in behavior(request, context):
                yield item

    return wrapper


def refuse_undecodable(request: Any) -> Any:
    """`request`, or InvalidArgument when its bytes did not decode (for the requests a
    bidirectional handler reads)."""
    _refuse_undecodable(request)
    return request


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
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.stream_stream),
                request_deserializer=tolerant_deserializer(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return handler


class CallerInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Admits a call only from a service whose credential it can verify, and only to a method
    `POWERS` grants that service.

    Health and reflection stay open so probes work; everything else of an internal service is
    reachable only from inside the platform, each caller within its own powers.
    """

    def __init__(self, verifiers: Mapping[str, str]) -> None:
        self._callers = dict(verifiers)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(_OPEN_PREFIXES):
            return await continuation(details)
        presented = dict(details.invocation_metadata or ()).get(CREDENTIAL_KEY, "")
        # A lookup by digest: the digest of a 256-bit secret leaks nothing through its timing.
        caller = self._callers.get(verifier(presented)) if isinstance(presented, str) else None
        service, _, method = details.method.lstrip("/").partition("/")
        if caller is None:
            status = grpc.StatusCode.UNAUTHENTICATED
            message = "internal service: calls must present a service credential it knows"
        elif method in POWERS.get(service, {}).get(caller, frozenset()):
            return await continuation(details)
        else:
            status = grpc.StatusCode.PERMISSION_DENIED
            message = f"the {caller} service may not call {service}/{method}"

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(status, message)

        handler = await continuation(details)
        if handler is not None and handler.stream_stream is not None:

            async def refuse_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                await context.abort(status, message)
                yield  # a generator, as a bidirectional handler is

            return grpc.stream_stream_rpc_method_handler(
                refuse_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(refuse)


async def start_server(
    *,
    host: str,
    port: int,
    register: Sequence[Callable[[grpc.aio.Server], None]],
    service_names: Sequence[str],
    verifiers: Mapping[str, str] | None,
    reflection_on: bool = True,
    max_connection_age_s: float | None = None,
    max_connection_age_grace_s: float | None = None,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Start a gRPC server with health checking, reflection and error mapping.

    `register` adds the service's servicers; `verifiers` (credential digest -> caller), when
    given, admits only those callers, each to its powers, on every call but health and
    reflection; `reflection_on` serves reflection; `max_connection_age_s` asks a client's
    connection to go away (GOAWAY) once it is that old, giving its calls
    `max_connection_age_grace_s` more to finish. Returns the server, the bound port and the
    health servicer (already SERVING).
    """
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if verifiers is not None:
        interceptors.append(CallerInterceptor(verifiers))
    interceptors.append(ErrorInterceptor())
    options: list[tuple[str, int]] = [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", 32 << 20),
    ]
    if max_connection_age_s is not None:
        options.append(("grpc.max_connection_age_ms", int(max_connection_age_s * 1000)))
    if max_connection_age_grace_s is not None:
        options.append(("grpc.max_connection_age_grace_ms", int(max_connection_age_grace_s * 1000)))
    server = grpc.aio.server(interceptors=interceptors, options=options)
    for add in register:
        add(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if reflection_on:
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


class _Credential:
    """Presents the caller's credential on every call."""

    def __init__(self, credential: str | None) -> None:
        self._pair = (CREDENTIAL_KEY, credential) if credential else None

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        if self._pair is None:
            return details
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(*self._pair)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _UnaryInterceptor(_Credential, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Presents the credential and, for a named callee, raises a call's failure as the
    TetherError the callee raised."""

    def __init__(self, credential: str | None, service: str | None) -> None:
        super().__init__(credential)
        self._service = service

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        call = await continuation(self._details(details), request)
        if self._service is None:
            return call
        try:
            await call
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, self._service) from exc
        return call


class _UnaryStreamInterceptor(_Credential, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Presents the credential on a server-streaming call."""

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _StreamStreamInterceptor(_Credential, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    """Presents the credential on a bidirectional call."""

    async def intercept_stream_stream(
        self, continuation: Any, details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(self._details(details), request_iterator)


def internal_channel(
    address: str, credential: str | None, *, service: str | None = None
) -> grpc.aio.Channel:
    """A channel to another Tether service, presenting this service's credential when set.

    With `service` (the callee's name) a unary call's failure is raised as the same TetherError
    the callee raised, and the callee being unreachable as UNAVAILABLE naming it; without it
    (tests that look at status codes) the raw grpc.aio.AioRpcError is raised."""
    # One object per kind of call: a channel files each interceptor under the first kind it is.
    interceptors = (
        [
            _UnaryInterceptor(credential, service),
            _UnaryStreamInterceptor(credential),
            _StreamStreamInterceptor(credential),
        ]
        if credential or service
        else None
    )
    return grpc.aio.insecure_channel(
        address,
        interceptors=interceptors,
        options=[("grpc.max_receive_message_length", 32 << 20)],
    )
