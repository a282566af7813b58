"""gRPC plumbing shared by every service: the server (health, reflection, error mapping,
the caller check, mutual TLS and a plaintext health-only port when configured) and client
channels that present the calling service's credential (over mutual TLS when configured)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from tether import telemetry
from tether.credentials import CREDENTIAL_KEY, POWERS, verifier
from tether.errors import (
    CODE_METADATA_KEY,
    InvalidArgument,
    PermissionDenied,
    TetherError,
    Unauthenticated,
    from_rpc_error,
)
from tether.runtime.tls import MutualTls
from tether.telemetry import tracing
from tether.telemetry.logs import bind_run

log = logging.getLogger(__name__)


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


def refuse_undecodable(request: Any) -> Any:
    """`request`, or InvalidArgument when its bytes did not decode (for the requests a
    bidirectional handler reads)."""
    _refuse_undecodable(request)
    return request


class _Callers:
    """Who calls, by the credential a call presents: verified once per credential (a lookup by
    digest: the digest of a 256-bit secret leaks nothing through its timing), then known."""

    def __init__(self, verifiers: Mapping[str, str]) -> None:
        self._by_digest = dict(verifiers)
        self._known: dict[str, str] = {}
        self.names = frozenset(self._by_digest.values())

    def of(self, context: grpc.aio.ServicerContext) -> str | None:
        """The calling service, or None when it presents no credential this server knows."""
        presented = ""
        for key, value in context.invocation_metadata() or ():
            if key == CREDENTIAL_KEY and isinstance(value, str):
                presented = value
        caller = self._known.get(presented)
        if caller is None and presented:
            caller = self._by_digest.get(verifier(presented))
            if caller is not None:
                self._known[presented] = caller  # only known callers: the map stays small
        return caller


def _admit(callers: _Callers | None, allowed: frozenset[str], method: str) -> Callable[..., None]:
    """The check a method makes of its caller before it runs: a service whose credential this
    server knows, and which `POWERS` lets call it (none for a public server)."""

    def check(context: grpc.aio.ServicerContext) -> None:
        if callers is None:
            return
        caller = callers.of(context)
        if caller is None:
            raise Unauthenticated(
                "internal service: calls must present a service credential it knows"
            )
        if caller not in allowed:
            raise PermissionDenied(f"the {caller} service may not call {method}")

    return check


def _guarded(
    handler: grpc.RpcMethodHandler, method: str, callers: _Callers | None
) -> grpc.RpcMethodHandler:
    """`handler` (the method `service/name`) wrapped once, at registration: the caller check,
    undecodable requests refused as the caller's mistake, TetherErrors answered with their
    status and stable code, the run a request names bound to the call's log lines, and, while
    telemetry is on, a server span continuing the caller's trace. (grpc's server interceptors
    would do this on every call.)"""
    service, _, name = method.partition("/")
    allowed = frozenset(c for c, names in POWERS.get(service, {}).items() if name in names)
    if service == reflection.SERVICE_NAME and callers is not None:
        allowed = callers.names  # every service this server knows may read what it serves
    admit = _admit(callers, allowed, method)
    deserializer = tolerant_deserializer(handler.request_deserializer)
    serializer = handler.response_serializer
    if handler.unary_unary is not None:
        behavior = handler.unary_unary
        if _names_a_run(handler.request_deserializer):
            behavior = _binding_run(behavior)
        if telemetry.on:
            behavior = tracing.traced_unary(behavior, method)
        answered_as = handler.unary_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with _answered(context, answered_as):
                admit(context)
                _refuse_undecodable(request)
                return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=deserializer, response_serializer=serializer
        )
    streaming = handler.unary_stream or handler.stream_stream
    if streaming is None:
        raise ValueError(f"{method}: client-streaming methods are not served")

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async with _answered(context, streaming):
            admit(context)
            _refuse_undecodable(request)  # a bidirectional handler checks each request it reads
            async for item in streaming(request, context):
                yield item

    make = (
        grpc.unary_stream_rpc_method_handler
        if handler.unary_stream is not None
        else grpc.stream_stream_rpc_method_handler
    )
    return make(stream, request_deserializer=deserializer, response_serializer=serializer)


def _names_a_run(deserialize: Callable[[bytes], Any] | None) -> bool:
    """Whether the request a deserializer makes (`Message.FromString`) has a run_id field."""
    message = getattr(deserialize, "__self__", None)
    descriptor = getattr(message, "DESCRIPTOR", None)
    return descriptor is not None and "run_id" in descriptor.fields_by_name


def _binding_run(behavior: Callable[..., Any]) -> Callable[..., Any]:
    """`behavior`, with the run its request names bound to the call's log lines (each call
    runs in a task of its own, so the binding ends with it)."""

    async def bound(request: Any, context: grpc.aio.ServicerContext) -> Any:
        bind_run(request.run_id, getattr(request, "tenant_id", ""))
        return await behavior(request, context)

    return bound


class _Registrar:
    """What a service's `register` callables add their servicers to: each method is wrapped
    once (`_guarded`), then served."""

    def __init__(self, server: grpc.aio.Server, callers: _Callers | None) -> None:
        self._server = server
        self._callers = callers

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """Ignored: the same methods come through `add_registered_method_handlers`."""

    def add_registered_method_handlers(
        self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler]
    ) -> None:
        """Serve `service`'s methods, each wrapped once."""
        wrapped = {
            name: _guarded(handler, f"{service}/{name}", self._callers)
            for name, handler in handlers.items()
        }
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, wrapped),)
        )
        self._server.add_registered_method_handlers(service, wrapped)


class _Reflection:
    """Reflection served through `_guarded` (the caller check): its requests come through the
    tolerant deserializer, so each is refused as the caller's mistake when it did not decode."""

    def __init__(self, service_names: Sequence[str]) -> None:
        self._inner = reflection.aio.ReflectionServicer(service_names)

    def ServerReflectionInfo(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        checked = (refuse_undecodable(request) async for request in requests)
        served: AsyncIterator[Any] = self._inner.ServerReflectionInfo(checked, context)
        return served


# The health service name that says only "the process serves" (liveness and startup probes);
# the server's overall health ("") and each service's name say "ready for calls".
LIVENESS = "liveness"


@dataclass
class RunningServer:
    """A started gRPC server: its bound port, its health (and the plaintext health-only server
    beside it, when it has one)."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    health_server: grpc.aio.Server | None = None
    health_port: int | None = None
    # Called first when the server stops: long-lived streams tell their callers to move on.
    on_stop: list[Callable[[], None]] = field(default_factory=list)

    async def ready(self) -> None:
        """Report SERVING for the server as a whole and for each of its services."""
        for name in ("", *self.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float | None) -> None:
        """Report NOT_SERVING everywhere (so no new caller is routed here), stop accepting and
        give calls in flight `grace` seconds; then stop the health-only server."""
        for hook in self.on_stop:
            hook()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(None)


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
    tls: MutualTls | None = None,
    health_port: int | None = None,
    ready: bool = True,
) -> RunningServer:
    """Start a gRPC server with health checking, reflection and error mapping.

    `register` adds the service's servicers; `verifiers` (credential digest -> caller), when
    given, admits only those callers, each to its powers, on every call but health (reflection
    to any of them); `reflection_on` serves reflection; `max_connection_age_s` asks a client's
    connection to go away (GOAWAY) once it is that old, giving its calls
    `max_connection_age_grace_s` more to finish. With `tls` the port is served over mutual
    TLS only. With `health_port` a second, plaintext server answers gRPC health alone there
    (probes that speak no TLS). `ready` False starts it NOT_SERVING (but `LIVENESS`) until
    `RunningServer.ready()`.
    """
    options: list[tuple[str, int]] = [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", 32 << 20),
    ]
    if max_connection_age_s is not None:
        options.append(("grpc.max_connection_age_ms", int(max_connection_age_s * 1000)))
    if max_connection_age_grace_s is not None:
        options.append(("grpc.max_connection_age_grace_ms", int(max_connection_age_grace_s * 1000)))
    server = grpc.aio.server(options=options)
    registrar = _Registrar(server, None if verifiers is None else _Callers(verifiers))
    for add in register:
        add(registrar)  # it takes what a servicer adds
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if reflection_on:
        reflected = [
            *service_names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ]
        if verifiers is None:
            reflection.enable_server_reflection(reflected, server)
        else:
            # An internal service's map of its methods is for the services that may call it,
            # not for whoever reaches its port.
            reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
                _Reflection(reflected), registrar
            )
    address = f"{host}:{port}"
    if tls is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, tls.server_credentials())
    health_server = None
    bound_health = None
    if health_port is not None:
        health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        bound_health = health_server.add_insecure_port(f"{host}:{health_port}")
    await health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    for name in ("", *service_names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    if health_server is not None:
        await health_server.start()
    running = RunningServer(
        server, bound, health_servicer, tuple(service_names), health_server, bound_health
    )
    if ready:
        await running.ready()
    return running


class _UnaryCall:
    """A unary method of another Tether service: the caller's credential on every call, and a
    failure raised as the TetherError the callee raised (for a named callee)."""

    def __init__(self, inner: Any, credential: tuple[str, str] | None, service: str | None) -> None:
        self._inner = inner
        self._credential = credential
        self._service = service
        # Chosen once: while telemetry is on, each call carries the caller's trace context.
        self._traced: Callable[[Any], Any] | None = tracing.outgoing if telemetry.on else None

    def __call__(self, request: Any, *, metadata: Any = None, **kwargs: Any) -> Any:
        if self._traced is not None:
            metadata = self._traced(metadata)
        call = self._inner(request, metadata=_with(metadata, self._credential), **kwargs)
        return call if self._service is None else self._answered(call)

    async def _answered(self, call: Any) -> Any:
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, self._service or "") from exc


class _StreamCall:
    """A streaming method of another Tether service: the caller's credential on every call."""

    def __init__(self, inner: Any, credential: tuple[str, str] | None) -> None:
        self._inner = inner
        self._credential = credential

    def __call__(self, request: Any = None, *, metadata: Any = None, **kwargs: Any) -> Any:
        return self._inner(request, metadata=_with(metadata, self._credential), **kwargs)


def _with(metadata: Any, credential: tuple[str, str] | None) -> Any:
    if credential is None:
        return metadata
    return (*(metadata or ()), credential)


class InternalChannel:
    """A channel to another Tether service (see `internal_channel`). Plain wrappers of the
    methods the generated stubs ask for, not grpc interceptors: an aio interceptor costs a task
    and an object chain on every call."""

    def __init__(self, channel: grpc.aio.Channel, credential: str | None, service: str | None):
        self._channel = channel
        self._credential = (CREDENTIAL_KEY, credential) if credential else None
        self._service = service

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> _UnaryCall:
        """A unary method (called by a generated stub)."""
        inner = self._channel.unary_unary(method, *args, **kwargs)
        return _UnaryCall(inner, self._credential, self._service)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> _StreamCall:
        """A server-streaming method."""
        return _StreamCall(self._channel.unary_stream(method, *args, **kwargs), self._credential)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> _StreamCall:
        """A client-streaming method."""
        return _StreamCall(self._channel.stream_unary(method, *args, **kwargs), self._credential)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> _StreamCall:
        """A bidirectional method."""
        return _StreamCall(self._channel.stream_stream(method, *args, **kwargs), self._credential)

    async def close(self, grace: float | None = None) -> None:
        """Close the channel."""
        await self._channel.close(grace)

    async def __aenter__(self) -> InternalChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def internal_channel(
    address: str,
    credential: str | None,
    *,
    service: str | None = None,
    tls: MutualTls | None = None,
    own_connection: bool = False,
) -> Any:
    """A channel to another Tether service, presenting this service's credential when set,
    over mutual TLS when `tls` is given (plaintext otherwise).

    With `service` (the callee's name) a unary call's failure is raised as the same TetherError
    the callee raised, and the callee being unreachable as UNAVAILABLE naming it; without it
    (tests that look at status codes) the raw grpc.aio.AioRpcError is raised. With
    `own_connection` the channel shares no connection with the process's other channels to the
    same address (grpc shares them by default), so a new one may reach another replica."""
    options = [("grpc.max_receive_message_length", 32 << 20)]
    if own_connection:
        options.append(("grpc.use_local_subchannel_pool", 1))
    if tls is None:
        channel = grpc.aio.insecure_channel(address, options=options)
    else:
        channel = grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)
    return InternalChannel(channel, credential, service)
