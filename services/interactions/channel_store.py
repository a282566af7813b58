"""Channel connections: how a tenant's Slack workspace, WhatsApp number or any other system
(a generic signed webhook) reaches its agents. Every secret is sealed with the secret store's
keys and no read returns one (a name and its last four characters at most). A rotation replaces
the verification secret and keeps the previous one valid for a grace period, so a provider still
signing with the old secret is not refused while its configuration catches up."""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncEngine

from services.interactions import channels_repository as channels_repo
from services.interactions.sealing import Keyring, Sealed, associated_data
from services.interactions.secret_store import MAX_SECRET_BYTES, last_four_of
from tether.errors import AlreadyExists, InvalidArgument, NotFound
from tether.ids import is_identifier, new_id
from tether.targets import TargetPolicy, check_url

KINDS = ("slack", "whatsapp", "webhook")
# Each kind's secrets, the verification secret (what signs the provider's webhooks) first.
SECRET_NAMES: dict[str, tuple[str, ...]] = {
    "slack": ("signing_secret", "bot_token"),
    "whatsapp": ("app_secret", "verify_token", "access_token"),
    "webhook": ("secret",),
}
# Each kind's non-secret settings, all required.
SETTING_NAMES: dict[str, tuple[str, ...]] = {
    "slack": (),
    "whatsapp": ("phone_number_id",),
    "webhook": ("text_field", "thread_field", "sender_field", "event_id_field"),
}
DEFAULT_API_BASE_URL = {
    "slack": "https://slack.com/api/",
    "whatsapp": "https://graph.facebook.com/v21.0/",
}
# A week: long enough for any provider's configuration to catch up, short enough that a leaked
# old secret does not stay useful.
MAX_GRACE = timedelta(days=7)
# Far above a real setting or URL, far below what a row should carry.
MAX_SETTING_CHARS = 2048


@dataclass(frozen=True)
class ChannelSpec:
    """What a caller asks for when adding a connection."""

    kind: str
    name: str
    agent: str = ""
    api_base_url: str = ""
    reply_url: str = ""
    settings: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class ChannelInfo:
    """What a read shows of a connection: never a secret's value."""

    channel_id: str
    kind: str
    name: str
    agent: str
    api_base_url: str
    reply_url: str
    settings: dict[str, str]
    secret_hints: dict[str, str]
    previous_secret_expires_at: datetime | None
    created_by: str
    created_at: datetime


@dataclass(frozen=True)
class Verification:
    """What the gateway verifies a provider's webhook with, and what it admits the verified
    message with: never a secret that sends (a bot token, an access token)."""

    tenant_id: str
    kind: str
    secrets: tuple[bytes, ...]
    verify_token: bytes = b""
    settings: dict[str, str] = field(default_factory=dict)
    agent: str = ""
    previous_expires_at: datetime | None = None


@dataclass(frozen=True)
class Sending:
    """What sends a channel run's answer, for that one delivery: never stored, logged or shown."""

    kind: str
    api_base_url: str
    reply_url: str
    settings: dict[str, str]
    credential: bytes
    signing_secret: bytes

    def __repr__(self) -> str:
        return f"Sending(kind={self.kind!r}, api_base_url={self.api_base_url!r}, secrets hidden)"


# Each kind's sending credential (Slack's bot token, WhatsApp's access token); a generic
# connection signs its answers with its verification secret instead.
SENDING_SECRET = {"slack": "bot_token", "whatsapp": "access_token"}


def _info(row: Row[Any, *tuple[Any, ...]]) -> ChannelInfo:
    return ChannelInfo(
        channel_id=row.channel_id,
        kind=row.kind,
        name=row.name,
        agent=row.agent or "",
        api_base_url=row.api_base_url or "",
        reply_url=row.reply_url or "",
        settings=dict(row.settings),
        secret_hints=dict(row.secret_hints),
        previous_secret_expires_at=row.previous_expires_at,
        created_by=row.created_by,
        created_at=row.created_at,
    )


def is_json_pointer(value: str) -> bool:
    """RFC 6901: empty, or '/'-separated tokens where '~' is only '~0' or '~1'."""
    if value == "":
        return True
    if not value.startswith("/"):
        return False
    for token in value[1:].split("/"):
        rest = token.replace("~0", "").replace("~1", "")
        if "~" in rest:
            return False
    return True


def _no_nul(what: str, value: str) -> None:
    if "\x00" in value:
        raise InvalidArgument(f"{what} contains a NUL byte")
    if len(value) > MAX_SETTING_CHARS:
        raise InvalidArgument(f"{what} is over {MAX_SETTING_CHARS} characters")


def _secret(what: str, value: bytes) -> None:
    if not value:
        raise InvalidArgument(f"{what} is required")
    if len(value) > MAX_SECRET_BYTES:
        raise InvalidArgument(f"{what} is over {MAX_SECRET_BYTES} bytes")
    if b"\x00" in value:
        raise InvalidArgument(f"{what} contains a NUL byte")


# Standard Webhooks secrets: `whsec_` and the base64 of 24 to 64 random bytes, as a sender
# (Svix, and every implementation of the specification) hands them out.
WHSEC_PREFIX = "whsec_"
WHSEC_BYTES = (24, 64)


def check_webhook_secret(value: bytes) -> None:
    """A generic webhook's secret is stored as the sender gave it, `whsec_<base64>`; the gateway
    hands that string to the `standardwebhooks` package, which signs with the decoded bytes. A
    secret in any other form would verify nothing the sender signs, so it is refused here."""
    text = value.decode("latin-1")
    encoded = text.removeprefix(WHSEC_PREFIX)
    try:
        key = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        key = b""
    low, high = WHSEC_BYTES
    if not text.startswith(WHSEC_PREFIX) or not low <= len(key) <= high:
        raise InvalidArgument(
            "a webhook channel's secret must be a Standard Webhooks secret: whsec_ followed by "
            f"the base64 of {low} to {high} random bytes (e.g. whsec_"
            "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw), as the sending system shows it"
        )


def _aad(tenant_id: str, channel_id: str, which: str) -> bytes:
    return associated_data(tenant_id, which, channel_id)


class ChannelStore:
    """Adds, reads, removes and rotates a tenant's channel connections."""

    def __init__(self, engine: AsyncEngine, keyring: Keyring, policy: TargetPolicy) -> None:
        self._engine = engine
        self._keyring = keyring
        self._policy = policy

    async def _validated(self, spec: ChannelSpec) -> tuple[str | None, str | None]:
        """The spec's (api_base_url, reply_url) once every field is acceptable."""
        if spec.kind not in KINDS:
            raise InvalidArgument(f"kind must be one of {', '.join(KINDS)}, not {spec.kind!r}")
        if not is_identifier(spec.name):
            raise InvalidArgument("name must be 1..128 of [A-Za-z0-9._:@-], starting alphanumeric")
        if spec.agent and not is_identifier(spec.agent):
            raise InvalidArgument("agent must be 1..128 of [A-Za-z0-9._:@-], starting alphanumeric")
        wanted = SECRET_NAMES[spec.kind]
        for extra in set(spec.secrets) - set(wanted):
            raise InvalidArgument(f"a {spec.kind} channel has no secret {extra!r}")
        for name in wanted:
            _secret(name, spec.secrets.get(name, b""))
        for extra in set(spec.settings) - set(SETTING_NAMES[spec.kind]):
            raise InvalidArgument(f"a {spec.kind} channel has no setting {extra!r}")
        for name in SETTING_NAMES[spec.kind]:
            value = spec.settings.get(name, "")
            _no_nul(name, value)
            if not value:
                raise InvalidArgument(f"{name} is required for a {spec.kind} channel")
            if name.endswith("_field") and not is_json_pointer(value):
                raise InvalidArgument(f"{name} must be a JSON pointer (RFC 6901), e.g. /text")
        if spec.kind == "webhook":
            check_webhook_secret(spec.secrets["secret"])
            if spec.api_base_url:
                raise InvalidArgument("a webhook channel takes reply_url, not api_base_url")
            _no_nul("reply_url", spec.reply_url)
            if not spec.reply_url:
                return None, None
            return None, await check_url(spec.reply_url, self._policy, what="reply_url")
        if spec.reply_url:
            raise InvalidArgument(f"a {spec.kind} channel takes api_base_url, not reply_url")
        _no_nul("api_base_url", spec.api_base_url)
        if not spec.api_base_url:
            # The provider's own address, not a tenant's choice: checked when connecting, like
            # every target, but not resolved here (a refusal would blame the caller for DNS).
            return DEFAULT_API_BASE_URL[spec.kind], None
        return await check_url(spec.api_base_url, self._policy, what="api_base_url"), None

    def _seal(self, tenant_id: str, channel_id: str, secrets: dict[str, bytes]) -> Sealed:
        body = json.dumps({k: v.decode("latin-1") for k, v in secrets.items()}).encode()
        return self._keyring.seal(body, _aad(tenant_id, channel_id, "channel"))

    def _open(self, tenant_id: str, channel_id: str, sealed: Sealed) -> dict[str, bytes]:
        body = self._keyring.open(sealed, _aad(tenant_id, channel_id, "channel"))
        return {k: v.encode("latin-1") for k, v in json.loads(body).items()}

    async def add(self, tenant_id: str, principal_id: str, spec: ChannelSpec) -> ChannelInfo:
        """Validate, seal and store a new connection."""
        api_base_url, reply_url = await self._validated(spec)
        channel_id = new_id("ch")
        sealed = self._seal(tenant_id, channel_id, spec.secrets)
        async with self._engine.begin() as conn:
            row = await channels_repo.insert_channel(
                conn,
                tenant_id=tenant_id,
                channel_id=channel_id,
                kind=spec.kind,
                name=spec.name,
                agent=spec.agent or None,
                api_base_url=api_base_url,
                reply_url=reply_url,
                settings=dict(spec.settings),
                sealed=sealed,
                secret_hints={k: last_four_of(v) for k, v in spec.secrets.items()},
                created_by=principal_id,
            )
        if row is None:
            raise AlreadyExists(f"a channel named {spec.name!r} exists; remove it first")
        return _info(row)

    async def list(self, tenant_id: str) -> list[ChannelInfo]:
        """The tenant's connections by name."""
        async with self._engine.connect() as conn:
            return [_info(r) for r in await channels_repo.list_channels(conn, tenant_id)]

    async def get(self, tenant_id: str, channel_id: str) -> ChannelInfo:
        """One connection; absent and another tenant's answer alike."""
        async with self._engine.connect() as conn:
            row = await channels_repo.find_channel(conn, tenant_id, channel_id)
        if row is None:
            raise NotFound(f"no channel {channel_id!r}")
        return _info(row)

    async def remove(self, tenant_id: str, channel_id: str) -> None:
        """Remove a connection; absent and another tenant's answer alike."""
        async with self._engine.begin() as conn:
            if not await channels_repo.delete_channel(conn, tenant_id, channel_id):
                raise NotFound(f"no channel {channel_id!r}")

    async def rotate(
        self, tenant_id: str, channel_id: str, new_secret: bytes, grace: timedelta
    ) -> ChannelInfo:
        """Replace the verification secret; the one replaced still verifies for `grace`."""
        _secret("secret", new_secret)
        if grace < timedelta(0) or grace > MAX_GRACE:
            raise InvalidArgument(f"grace must be between 0 and {MAX_GRACE.days} days")
        async with self._engine.begin() as conn:
            row = await channels_repo.sealed_for_rotation(conn, tenant_id, channel_id)
            if row is None:
                raise NotFound(f"no channel {channel_id!r}")
            secrets = self._open(
                tenant_id, channel_id, Sealed(row.ciphertext, row.nonce, row.key_id)
            )
            verifying = SECRET_NAMES[row.kind][0]
            if row.kind == "webhook":
                check_webhook_secret(new_secret)
            previous = self._keyring.seal(
                secrets[verifying], _aad(tenant_id, channel_id, "channel-previous")
            )
            secrets[verifying] = new_secret
            hints = dict(row.secret_hints)
            hints[verifying] = last_four_of(new_secret)
            await channels_repo.store_rotation(
                conn,
                tenant_id=tenant_id,
                channel_id=channel_id,
                sealed=self._seal(tenant_id, channel_id, secrets),
                secret_hints=hints,
                previous=previous,
                grace=grace,
            )
            shown = await channels_repo.find_channel(conn, tenant_id, channel_id)
        assert shown is not None  # the row is locked by this transaction
        return _info(shown)

    async def sending(self, tenant_id: str, channel_id: str) -> Sending:
        """What sends an answer through the tenant's connection; NotFound when it is gone."""
        async with self._engine.connect() as conn:
            row = await channels_repo.sealed_for_sending(conn, tenant_id, channel_id)
        if row is None:
            raise NotFound(f"no channel {channel_id!r}")
        secrets = self._open(tenant_id, channel_id, Sealed(row.ciphertext, row.nonce, row.key_id))
        if row.kind == "webhook":
            credential, signing = b"", secrets["secret"]
        else:
            credential, signing = secrets[SENDING_SECRET[row.kind]], b""
        return Sending(
            kind=row.kind,
            api_base_url=row.api_base_url or "",
            reply_url=row.reply_url or "",
            settings=dict(row.settings),
            credential=credential,
            signing_secret=signing,
        )

    async def verification(self, channel_id: str) -> Verification:
        """A connection's tenant, kind and the verification secrets valid now (the current one,
        then the previous one while its grace lasts), WhatsApp's verify token, the settings and
        the agent."""
        if not is_identifier(channel_id):
            raise NotFound(f"no channel {channel_id!r}")
        async with self._engine.connect() as conn:
            row = await channels_repo.verification_row(conn, channel_id)
        if row is None:
            raise NotFound(f"no channel {channel_id!r}")
        tenant_id = row.tenant_id
        current = self._open(tenant_id, channel_id, Sealed(row.ciphertext, row.nonce, row.key_id))
        valid = [current[SECRET_NAMES[row.kind][0]]]
        if row.previous_valid:
            valid.append(
                self._keyring.open(
                    Sealed(row.previous_ciphertext, row.previous_nonce, row.previous_key_id),
                    _aad(tenant_id, channel_id, "channel-previous"),
                )
            )
        return Verification(
            tenant_id,
            row.kind,
            tuple(valid),
            verify_token=current.get("verify_token", b""),
            settings=dict(row.settings),
            agent=row.agent or "",
            previous_expires_at=row.previous_expires_at if row.previous_valid else None,
        )
