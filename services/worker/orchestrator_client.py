"""The worker's only authority: writes to the orchestrator under a lease, on the Work stream.
Refusals arrive as TetherErrors (StaleLease for a refused epoch).

Protobuf stops here for writes: each is built into its request, checkpoints and completions by
`tether.convert.work`. (A pushed lease becomes an `Assignment` where it arrives, in
`work_stream`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from google.protobuf import json_format

from services.worker import observed
from services.worker.context.builder import Document
from services.worker.delegation import Child
from services.worker.work_stream import WorkStream
from tether import telemetry
from tether.convert import (
    error_from_proto,
    error_to_proto,
    event_to_wire,
    part_to_proto,
    status_from_proto,
    status_to_proto,
    timestamp,
)
from tether.convert.deliveries import delivery_from_proto
from tether.convert.work import checkpoint_to_proto, completion_to_proto, effect_from_proto
from tether.domain import (
    Batch,
    Completion,
    Delegation,
    Delivery,
    EffectState,
    Ending,
    Event,
    Lease,
    Part,
    ReplyTarget,
    RunError,
)
from tether.domain.deliveries import PENDING
from tether.states import RunStatus
from tether.v1 import orchestrator_pb2


class Orchestrator:
    """The writes of attempts, as the orchestrator answers them on this worker's Work stream."""

    def __init__(self, stream: WorkStream) -> None:
        self._stream = stream

    async def checkpoint(self, lease: Lease, batch: Batch) -> bool:
        """Persist a numbered batch of progress; whether the caller asked to cancel the run."""
        response: orchestrator_pb2.CheckpointResponse = await self._stream.write(
            checkpoint_to_proto(lease, batch)
        )
        return response.cancel_requested

    async def complete(
        self,
        lease: Lease,
        ending: Ending,
        *,
        rest: Batch,
        in_flight: Batch | None,
        stages: dict[str, float],
    ) -> None:
        """End the run with `ending`, carrying the progress not yet written: `rest`, and the
        numbered checkpoint still in flight (it lands once, whichever arrives first)."""
        request = completion_to_proto(
            lease,
            Completion(
                ending,
                parts=rest.parts,
                events=rest.events,
                turns=rest.turns,
                stages=stages,
                in_flight=in_flight,
            ),
        )
        if telemetry.on:
            request.traceparent = observed.traceparent()
        await self._stream.write(request)

    async def schedule_retry(self, lease: Lease, error: RunError, retry_after_s: float) -> None:
        """Report a transient failure."""
        await self._stream.write(
            orchestrator_pb2.ScheduleRetryRequest(
                run_id=lease.run_id,
                epoch=lease.epoch,
                error=error_to_proto(error),
                retry_after_seconds=retry_after_s,
                traceparent=observed.traceparent(),
            ),
        )

    @property
    def model_limits(self) -> bool:
        """Whether the replica keeps model rate limits (calls are reserved and settled)."""
        return bool(getattr(self._stream, "model_limits", False))

    async def reserve_model(
        self, lease: Lease, credential: str, model: str, input_tokens: int, output_tokens: int
    ) -> tuple[int, float]:
        """(reservation id, 0), or (0, seconds until the buckets hold the call)."""
        response: orchestrator_pb2.ReserveModelResponse = await self._stream.write(
            orchestrator_pb2.ReserveModelRequest(
                run_id=lease.run_id,
                epoch=lease.epoch,
                credential_id=credential,
                model=model,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
            )
        )
        return response.reservation_id, response.wait_ms / 1000

    async def settle_model(
        self,
        reservation_id: int,
        credential: str,
        model: str,
        used: tuple[int, int] | None,
        headers: dict[str, str],
        headers_age_s: float = 0.0,
    ) -> None:
        """Settle a reservation with the (input, output) tokens used and the headers seen
        `headers_age_s` ago."""
        request = orchestrator_pb2.SettleModelRequest(
            reservation_id=reservation_id,
            credential_id=credential,
            model=model,
            used=used is not None,
            headers=headers,
            headers_age_s=headers_age_s,
        )
        if used is not None:
            request.input_tokens, request.output_tokens = used
        await self._stream.write(request)

    async def park(
        self,
        lease: Lease,
        status: RunStatus,
        interaction_id: str,
        *,
        wake_at: datetime | None = None,
        tool_call_id: str = "",
        tool_call_ids: Sequence[str] = (),
    ) -> None:
        """Park the run for a person, on its timer until `wake_at`, or until the children of
        its delegate calls `tool_call_ids` have ended; the lease is released."""
        await self._stream.write(
            orchestrator_pb2.ParkRunRequest(
                run_id=lease.run_id,
                epoch=lease.epoch,
                status=status_to_proto(status),
                interaction_id=interaction_id,
                traceparent=observed.traceparent(),
                wake_at=timestamp(wake_at),
                tool_call_id=tool_call_id,
                tool_call_ids=list(tool_call_ids),
            ),
        )

    async def start_child(
        self,
        lease: Lease,
        tool_call_id: str,
        agent: str,
        message: str,
        delegation: Delegation,
        *,
        share: int = 1,
        park: Sequence[str] = (),
        new_call: bool = False,
        checkpoint: Batch | None = None,
    ) -> Child:
        """Start (or find: one per call) the child run of the delegate call `tool_call_id`,
        reserving 1/`share` of what the run has left, and park the run on the children of the
        calls `park` (the turn's last call: see StartChildRequest) in the same transaction; a
        `new_call` (made in this attempt's turn) is not looked for before the parent's lock;
        `checkpoint` (`CheckpointWriter.carry`) is written first, in the same transaction;
        InvalidArgument when the orchestrator refuses it (the model may act on its message)."""
        response: orchestrator_pb2.StartChildResponse = await self._stream.write(
            orchestrator_pb2.StartChildRequest(
                run_id=lease.run_id,
                epoch=lease.epoch,
                tool_call_id=tool_call_id,
                agent=agent,
                message=message,
                max_depth=delegation.max_depth,
                max_children=delegation.max_children,
                traceparent=observed.traceparent(),
                share=share,
                park_tool_call_ids=list(park),
                new_call=new_call,
                checkpoint=None if checkpoint is None else checkpoint_to_proto(lease, checkpoint),
            ),
        )
        return Child(
            response.child_run_id,
            status_from_proto(response.status) or RunStatus.QUEUED,
            response.result_text,
            error_from_proto(response.error) if response.HasField("error") else None,
            response.created,
            response.parked,
        )

    async def release(self, lease: Lease) -> None:
        """Hand the lease back."""
        await self._stream.write(
            orchestrator_pb2.ReleaseRunRequest(
                run_id=lease.run_id, epoch=lease.epoch, traceparent=observed.traceparent()
            ),
        )

    async def store_tool_output(self, lease: Lease, output_ref: str, content: str) -> None:
        """Store a tool's whole output under `output_ref` (its inline copy was cut)."""
        await self._stream.write(
            orchestrator_pb2.StoreToolOutputRequest(
                run_id=lease.run_id, epoch=lease.epoch, output_ref=output_ref, content=content
            ),
        )

    async def begin_effect(
        self, lease: Lease, key: str, tool_name: str
    ) -> tuple[EffectState, dict[str, Any] | None]:
        """Open the effects record of a side effect (or find it, with its result when done)."""
        response: orchestrator_pb2.BeginEffectResponse = await self._stream.write(
            orchestrator_pb2.BeginEffectRequest(
                run_id=lease.run_id, epoch=lease.epoch, key=key, tool_name=tool_name
            ),
        )
        return effect_from_proto(response)

    async def finish_effect(self, lease: Lease, key: str, result: dict[str, Any]) -> None:
        """Store a side effect's result."""
        request = orchestrator_pb2.FinishEffectRequest(
            run_id=lease.run_id, epoch=lease.epoch, key=key
        )
        json_format.ParseDict(result, request.result)
        await self._stream.write(request)

    async def begin_delivery(
        self,
        lease: Lease,
        target: ReplyTarget,
        text: str,
        *,
        awaiting_approval: bool = False,
        find_only: bool = False,
    ) -> tuple[Delivery | None, bool]:
        """Record the run's answer before it goes out (or find the record an earlier attempt
        made, with its text): (the delivery, whether this call recorded it)."""
        response: orchestrator_pb2.BeginDeliveryResponse = await self._stream.write(
            orchestrator_pb2.BeginDeliveryRequest(
                run_id=lease.run_id,
                epoch=lease.epoch,
                channel_id=target.channel_id,
                kind=target.kind,
                text=text,
                awaiting_approval=awaiting_approval,
                find_only=find_only,
            ),
        )
        if not response.found:
            return None, False
        return delivery_from_proto(response.delivery, lease.run_id), response.created

    async def record_delivery(
        self,
        lease: Lease,
        delivery_id: str,
        state: str,
        *,
        provider_message_id: str = "",
        error: RunError | None = None,
        calls: int = 0,
    ) -> Delivery:
        """Move the delivery on (an outcome appends its delivery.* event); as recorded now."""
        request = _delivery_request(lease, delivery_id, state, calls)
        request.provider_message_id = provider_message_id
        if error is not None:
            request.error.CopyFrom(error_to_proto(error))
        response: orchestrator_pb2.RecordDeliveryResponse = await self._stream.write(request)
        return delivery_from_proto(response.delivery, lease.run_id)

    async def count_delivery_call(self, lease: Lease, delivery_id: str) -> datetime | None:
        """Count a provider call about to be made (before it is: a later attempt knows one may
        have landed); when the lease that write extended lapses (None: the orchestrator did not
        say, a release before it did)."""
        request = _delivery_request(lease, delivery_id, PENDING, calls=1)
        response: orchestrator_pb2.RecordDeliveryResponse = await self._stream.write(request)
        if not response.HasField("lease_expires_at"):
            return None
        return response.lease_expires_at.ToDatetime(tzinfo=UTC)

    async def find_channel_status(
        self, lease: Lease, channel_id: str, callback_data: str
    ) -> str | None:
        """The provider message id a status callback reported for `callback_data`, or None."""
        response: orchestrator_pb2.FindChannelStatusResponse = await self._stream.write(
            orchestrator_pb2.FindChannelStatusRequest(
                run_id=lease.run_id,
                epoch=lease.epoch,
                channel_id=channel_id,
                callback_data=callback_data,
            ),
        )
        return response.provider_message_id if response.found else None

    async def retrieve_knowledge(
        self, lease: Lease, query: str, *, limit: int, max_chars: int
    ) -> list[Document]:
        """The documents of the run's tenant that match `query`, best first."""
        response: orchestrator_pb2.RetrieveKnowledgeResponse = await self._stream.write(
            orchestrator_pb2.RetrieveKnowledgeRequest(
                run_id=lease.run_id,
                epoch=lease.epoch,
                query=query,
                limit=limit,
                max_chars=max_chars,
            ),
        )
        return [Document(d.document_id, d.title, d.text) for d in response.documents]

    async def store_summary(self, lease: Lease, part: Part, events: Sequence[Event]) -> None:
        """Store a compaction summary (a part of the run) and its events, once per range."""
        await self._stream.write(
            orchestrator_pb2.StoreSummaryRequest(
                run_id=lease.run_id,
                epoch=lease.epoch,
                part=part_to_proto(part),
                events=[event_to_wire(e) for e in events],
            ),
        )


class LeasedEffects:
    """The effects record, fenced by one lease (implements EffectsPort)."""

    def __init__(self, orchestrator: Orchestrator, lease: Lease) -> None:
        self._orchestrator = orchestrator
        self._lease = lease

    async def begin(self, key: str, tool_name: str) -> tuple[EffectState, dict[str, Any] | None]:
        """Open the record."""
        return await self._orchestrator.begin_effect(self._lease, key, tool_name)

    async def finish(self, key: str, result: dict[str, Any]) -> None:
        """Store the result."""
        await self._orchestrator.finish_effect(self._lease, key, result)


def _delivery_request(
    lease: Lease, delivery_id: str, state: str, calls: int
) -> orchestrator_pb2.RecordDeliveryRequest:
    """A RecordDeliveryRequest for the delivery under `lease`: its state and calls counted."""
    return orchestrator_pb2.RecordDeliveryRequest(
        run_id=lease.run_id, epoch=lease.epoch, delivery_id=delivery_id, state=state, calls=calls
    )
