"""The soak's flood: one more tenant that keeps a large backlog of queued runs in front of the
pool for the whole soak (one-turn runs, each its own conversation, sent through a random gateway
replica by several senders at once, topped up as the pool drains it), and a quiet tenant beside
it that sends one run at a time, the next once the last has ended. The load's and the channels'
tenants go on too (quiet or not, as the machine's pace makes them); the checker then reads,
from the runs' own times, how many of the flood's runs were leased while each quiet tenant's run
waited to be leased, with the flood's backlog large (`checker._quiet_waits`)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass, field

import grpc
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.drill.checker import TERMINAL
from tests.drill.infra import DrillTenant, World
from tether.db.engine import create_engine
from tether.db.schema import runs
from tether.testing.model_script import TextTurn
from tether.v1 import gateway_pb2, gateway_pb2_grpc

log = logging.getLogger("drill.flood")

# The flood keeps about this many runs queued: twice the backlog the checker measures quiet runs
# behind (checker.FLOOD_BACKLOG), four pools' worth of slots, and few enough to drain within the
# settle time even on a machine so loaded that the pool leases a few runs a second.
BACKLOG = 100
SENDERS = 8
CALL_TIMEOUT_S = 10.0
# How often the backlog is read (and topped up): the pool drains a few runs in that time.
TOP_UP_EVERY_S = 0.25


# The quiet tenant's pace: a run, its end, then a pause of this many seconds (seeded).
QUIET_PAUSE_S = (0.2, 1.0)
# How long the quiet tenant waits for its run to end before sending the next anyway.
QUIET_RUN_BOUND_S = 60.0


@dataclass
class FloodObservations:
    """What the flood did: runs admitted, sends refused (an outage), and the backlog it read;
    and the quiet tenant's runs."""

    sent: int = 0
    failed: int = 0
    backlog_max: int = 0
    backlog_samples: list[int] = field(default_factory=list)
    quiet_sent: int = 0


class FloodLoad:
    """Keeps `BACKLOG` runs of the world's flood tenant queued, and sends the quiet tenant's runs
    one at a time, until `run`'s deadline."""

    def __init__(self, world: World, rng: random.Random, obs: FloodObservations) -> None:
        self._world = world
        self._rng = rng
        self._obs = obs
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def run(self, until: float) -> None:
        """The flood and the quiet tenant, until `until` (monotonic)."""
        engine = create_engine(self._world.db_url, pool_size=2)
        try:
            await asyncio.gather(self._flood(engine, until), self._quiet(engine, until))
        finally:
            await engine.dispose()
            for channel in self._channels.values():
                await channel.close()

    async def _quiet(self, engine: AsyncEngine, until: float) -> None:
        """One run of the quiet tenant at a time: sent, watched to its end, a pause."""
        rng = random.Random(self._rng.random())
        while time.monotonic() < until:
            run_id = await self._one(self._world.quiet_tenant, "quiet")
            if run_id is not None:
                self._obs.quiet_sent += 1
                await self._ended(engine, run_id, time.monotonic() + QUIET_RUN_BOUND_S)
            await asyncio.sleep(rng.uniform(*QUIET_PAUSE_S))  # a person's pace

    async def _ended(self, engine: AsyncEngine, run_id: str, deadline: float) -> None:
        """Until run `run_id` is terminal, or `deadline`."""
        status = select(runs.c.status).where(runs.c.run_id == run_id)
        while time.monotonic() < deadline:
            try:
                async with engine.connect() as conn:
                    if (await conn.execute(status)).scalar_one() in TERMINAL:
                        return
            except Exception:  # the database is down (a fault): look again shortly
                pass
            await asyncio.sleep(0.1)  # polling the run's status: nothing to subscribe to here

    async def _flood(self, engine: AsyncEngine, until: float) -> None:
        """Top the backlog up to BACKLOG every TOP_UP_EVERY_S, until `until`."""
        queued = (
            select(func.count())
            .select_from(runs)
            .where(
                runs.c.tenant_id == self._world.flood_tenant.tenant_id,
                runs.c.status == "queued",
            )
        )
        while time.monotonic() < until:
            try:
                async with engine.connect() as conn:
                    backlog = int((await conn.execute(queued)).scalar_one())
            except Exception:  # the database is down (a fault): try again shortly
                await asyncio.sleep(TOP_UP_EVERY_S)  # backoff against an outage
                continue
            self._obs.backlog_max = max(self._obs.backlog_max, backlog)
            self._obs.backlog_samples.append(backlog)
            wanted = BACKLOG - backlog
            if wanted > 0:
                await self._send(wanted, until)
            await asyncio.sleep(TOP_UP_EVERY_S)  # the pool's pace, not synchronisation

    async def _send(self, count: int, until: float) -> None:
        """`count` runs, SENDERS at a time."""
        todo = iter(range(count))

        async def sender() -> None:
            for _ in todo:
                if time.monotonic() >= until:
                    return
                if await self._one(self._world.flood_tenant, "flood") is None:
                    self._obs.failed += 1
                else:
                    self._obs.sent += 1

        await asyncio.gather(*(sender() for _ in range(SENDERS)))

    async def _one(self, tenant: DrillTenant, kind: str) -> str | None:
        """One one-turn run of `tenant` in a conversation of its own; its run id, or None when
        the call failed (an outage: the caller goes on)."""
        tag = uuid.uuid4().hex[:12]
        text = f"drill {kind} {tag}"
        self._world.model.script(text, [TextTurn(f"{kind} answer {tag}")])
        request = gateway_pb2.SendMessageRequest(
            event_id=f"{kind}-{tag}", conversation_id=f"{kind}-{tag}", text=text
        )
        metadata = (("authorization", f"Bearer {tenant.api_key}"),)
        try:
            sent = await self._stub().SendMessage(
                request, metadata=metadata, timeout=CALL_TIMEOUT_S
            )
        except grpc.aio.AioRpcError:
            # The load's own calls are judged by the checker; these only make the pool busy
            # and measure it. (The script stays: a run admitted before the call timed out
            # still finds its turn.)
            return None
        return str(sent.run.run_id)

    def _stub(self) -> gateway_pb2_grpc.GatewayServiceStub:
        address = self._rng.choice(self._world.gateways())
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        return gateway_pb2_grpc.GatewayServiceStub(channel)
