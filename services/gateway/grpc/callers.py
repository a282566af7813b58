"""Who calls: every RPC of the gateway starts here, whichever handler serves it."""

from __future__ import annotations

import grpc
from google.protobuf.message import Message

from services.gateway.auth import Authenticator, KeyWatch
from tether.apikeys import Principal
from tether.limits import check_request


class Callers:
    """Authenticates a call's metadata for its method and holds its request to the limits."""

    def __init__(self, auth: Authenticator) -> None:
        self._auth = auth

    async def authenticated(
        self, context: grpc.aio.ServicerContext, method: str, request: Message
    ) -> Principal:
        """The authenticated caller, once `request` is within every field's limit."""
        metadata = dict(context.invocation_metadata() or ())
        principal = await self._auth.authenticate(metadata, method)
        check_request(request)
        return principal

    def key_watch(self, context: grpc.aio.ServicerContext, method: str) -> KeyWatch:
        """A watch that ends an open stream once the key it was opened with stops holding."""
        return KeyWatch(self._auth, dict(context.invocation_metadata() or ()), method)
