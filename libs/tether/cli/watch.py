"""`tether watch`, `tether cancel` and `tether send --follow`: follow a run live from a shell.

Text output renders the run as it happens: assistant text as it streams, tool calls and their
results, a live retry indicator (attempt and countdown), pauses with the command that resolves
them. `--json` prints one object per line: the snapshot, then every event (`tether.transport`
form; every durable event carries its `seq`). The stream reconnects by itself from its cursor.
Exit status: 0 when the run completed, 1 when it failed or was cancelled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

import grpc
from google.protobuf import json_format

from tether.client import TetherClient, run_to_dict
from tether.domain import TERMINAL_EVENTS
from tether.transport import event_to_json, snapshot_to_json, status_name
from tether.v1 import events_pb2, gateway_pb2

Emit = Any
_TICK_S = 0.1  # countdown refresh on a terminal


def _client(args: argparse.Namespace) -> TetherClient:
    return TetherClient.from_env(getattr(args, "stack", None))


def _compact(data: Any, limit: int = 80) -> str:
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Renderer:
    """Turns a run's stream into lines a person can follow."""

    def __init__(self, client: TetherClient, run_id: str, out: TextIO) -> None:
        self._client = client
        self._run_id = run_id
        self._out = out
        self._live = out.isatty()
        self._texts: dict[int, str] = {}  # text known per part index
        self._printed: dict[int, int] = {}  # characters of it already written
        self._streaming: int | None = None  # part whose text the cursor sits after
        self._calls: dict[str, str] = {}  # tool call id -> tool name
        self._shown: set[tuple[int, bool]] = set()
        self._dropped: set[int] = set()  # superseded parts: printed no further
        self._countdown: asyncio.Task[None] | None = None
        self._started = False

    # -- output ---------------------------------------------------------------------------------

    def _write(self, text: str) -> None:
        self._out.write(text)
        self._out.flush()

    def _line(self, text: str) -> None:
        self._stop_countdown()
        if self._streaming is not None:
            self._write("\n")
            self._streaming = None
        self._write(text + "\n")

    def _stream(self, index: int) -> None:
        text = self._texts.get(index, "")
        done = self._printed.get(index, 0)
        if len(text) <= done:
            return
        self._stop_countdown()
        if self._streaming not in (None, index):
            self._write("\n")
        self._write(text[done:])
        self._printed[index] = len(text)
        self._streaming = index

    # -- the stream -----------------------------------------------------------------------------

    def snapshot(self, snapshot: gateway_pb2.RunSnapshot, after_seq: int) -> None:
        """The first snapshot introduces the run; later ones (reconnects) say nothing."""
        if self._started:
            return
        self._started = True
        run = run_to_dict(snapshot.run)
        self._line(f"run {run['run_id']} {run['status']}")
        if after_seq:
            # Resuming mid-run: what is already there is not repeated.
            for part in snapshot.parts:
                if part.WhichOneof("kind") == "text":
                    self._texts[part.index] = part.text.text
                    self._printed[part.index] = len(part.text.text)
                elif part.WhichOneof("kind") == "tool_call":
                    self._calls[part.tool_call.tool_call_id] = part.tool_call.name

    async def event(self, event: events_pb2.RunEvent) -> None:
        """Render one event."""
        kind = event.WhichOneof("payload")
        if kind == "text_delta":
            self._delta(event.text_delta)
        elif kind in ("part_added", "part_updated"):
            part = event.part_added.part if kind == "part_added" else event.part_updated.part
            self._part(part)
        elif kind == "part_superseded":
            self._superseded(event.part_superseded)
        elif kind == "run_retry_pending":
            self._retry(event.run_retry_pending)
        elif kind == "run_started" and event.run_started.attempt > 1:
            self._line(f"[attempt {event.run_started.attempt}] started")
        elif kind == "tool_failed":
            failed = event.tool_failed
            self._line(f"[tool] {failed.name} failed: {failed.error.message or failed.error.code}")
        elif kind in ("question_requested", "approval_requested", "connection_requested"):
            await self._pause(kind)
        elif kind == "question_answered":
            self._line("[question] answered; resuming")
        elif kind == "approval_decided":
            self._line(f"[approval] {event.approval_decided.decision}")
        elif kind == "connection_completed":
            self._line(f"[connection] {event.connection_completed.outcome}")
        elif kind == "timer_set":
            due = event.timer_set.due_at.ToJsonString()
            self._line(f"[timer] waiting until {due}, holding no worker")
        elif kind == "timer_fired":
            self._line(f"[timer] woke (due {event.timer_fired.due_at.ToJsonString()})")
        elif kind == "context_compacted":
            done = event.context_compacted
            self._line(
                f"[context] {done.runs_compacted} earlier runs summarised "
                f"({done.tokens_before} -> {done.tokens_after} tokens)"
            )
        elif kind == "run_completed":
            usage = event.run_completed.usage
            cost = f", ${usage.cost_micros / 1e6:.4f}" if usage.cost_micros else ""
            self._line(
                f"[completed] {usage.input_tokens} in / {usage.output_tokens} out tokens{cost}"
            )
        elif kind == "run_failed":
            error = event.run_failed.error
            self._line(f"[failed] {error.code}: {error.message}")
        elif kind == "run_cancelled":
            self._line(f"[cancelled] {event.run_cancelled.reason or 'by request'}")

    def _delta(self, delta: events_pb2.TextDelta) -> None:
        if delta.part_index in self._dropped:
            return
        current = self._texts.get(delta.part_index, "")
        start, end = delta.offset, delta.offset + len(delta.text)
        if start <= len(current) < end:
            self._texts[delta.part_index] = current + delta.text[len(current) - start :]
            self._stream(delta.part_index)

    def _part(self, part: Any) -> None:
        if part.index in self._dropped:
            return
        kind = part.WhichOneof("kind")
        if kind == "text":
            if len(part.text.text) >= len(self._texts.get(part.index, "")):
                self._texts[part.index] = part.text.text
            self._stream(part.index)
            if part.final and self._streaming == part.index:
                self._write("\n")
                self._streaming = None
        elif kind == "tool_call" and part.final and (part.index, True) not in self._shown:
            self._shown.add((part.index, True))
            call = part.tool_call
            self._calls[call.tool_call_id] = call.name
            arguments = json_format.MessageToDict(call.input)
            self._line(f"[tool] {call.name} {_compact(arguments)}")
        elif kind == "tool_result" and (part.index, False) not in self._shown:
            self._shown.add((part.index, False))
            result = part.tool_result
            name = self._calls.get(result.tool_call_id, "tool")
            verb = "error" if result.is_error else "->"
            first = result.content.strip().splitlines()[0] if result.content.strip() else ""
            self._line(f"[tool] {name} {verb} {_compact(first)[1:-1]}")

    def _superseded(self, superseded: events_pb2.PartSuperseded) -> None:
        """A terminal cannot take back what it printed: say that the cut-off output does not
        count, and print nothing more of that part (a late delta included)."""
        index = superseded.part_index
        self._dropped.add(index)
        if self._printed.get(index) or (index, True) in self._shown:
            self._line(
                f"[superseded] attempt {superseded.attempt} was cut off: the next attempt "
                "answers again"
            )

    def _retry(self, pending: events_pb2.RunRetryPending) -> None:
        error = pending.error
        reason = error.code + (f" ({error.message})" if error.message else "")
        head = f"[retry] attempt {pending.attempt}/{pending.max_attempts} failed: {reason}"
        due = (
            pending.next_attempt_at.ToDatetime(UTC) if pending.HasField("next_attempt_at") else None
        )

        def remaining() -> str:
            if due is None:
                return f"attempt {pending.attempt + 1} soon"
            seconds = max((due - datetime.now(UTC)).total_seconds(), 0.0)
            return f"attempt {pending.attempt + 1} in {seconds:.1f}s"

        if not self._live:
            self._line(f"{head}; {remaining()}")
            return
        self._line(head)

        async def tick() -> None:
            while True:
                self._write(f"\r        {remaining()}   ")
                await asyncio.sleep(_TICK_S)  # a countdown redraws on a clock

        self._countdown = asyncio.create_task(tick(), name="retry-countdown")

    def _stop_countdown(self) -> None:
        if self._countdown is not None:
            self._countdown.cancel()
            self._countdown = None
            self._write("\r\x1b[2K")

    async def _pause(self, kind: str) -> None:
        run = self._run_id
        if kind == "question_requested":
            keys = "KEY=VALUE ..."
            with contextlib.suppress(grpc.aio.AioRpcError):
                asked = await self._client.pending_question(run)
                if asked.HasField("question"):
                    for spec in asked.question.questions:
                        options = f" [{'|'.join(spec.options)}]" if spec.options else ""
                        self._line(f"[question] {spec.key}: {spec.prompt}{options}")
                    keys = " ".join(f"{spec.key}=..." for spec in asked.question.questions)
            self._line(f"waiting for an answer: tether answer {run} {keys}")
        elif kind == "approval_requested":
            decisions = ["allow-once", "allow-conversation", "allow-always", "deny"]
            with contextlib.suppress(grpc.aio.AioRpcError):
                gated = await self._client.pending_approval(run)
                if gated.HasField("approval"):
                    approval = gated.approval
                    self._line(f"[approval] {approval.tool_name}: {approval.summary}")
                    decisions = list(approval.allowed_decisions) or decisions
            self._line(f"waiting for approval: tether decide {run} {'|'.join(decisions)}")
        else:
            with contextlib.suppress(grpc.aio.AioRpcError):
                offer = await self._client.pending_connection(run)
                if offer.HasField("connection"):
                    connection = offer.connection
                    self._line(f"[connection] {connection.provider}: {connection.login_url}")
            self._line(f"waiting for a connection: tether connect {run} [--complete]")

    def close(self) -> None:
        """End the output cleanly (no dangling countdown or half line)."""
        self._stop_countdown()
        if self._streaming is not None:
            self._write("\n")
            self._streaming = None


async def follow(
    client: TetherClient,
    run_id: str,
    *,
    after_seq: int = 0,
    as_json: bool = False,
    deltas: bool = True,
    out: TextIO | None = None,
) -> int:
    """Render the run until it ends; 0 when it completed, 1 otherwise."""
    stream = out or sys.stdout
    renderer = Renderer(client, run_id, stream)
    outcome = ""
    try:
        async for item in client.watch(run_id, after_seq=after_seq, include_deltas=deltas):
            if item.HasField("snapshot"):
                snapshot = item.snapshot
                outcome = status_name(snapshot.run.status)
                if as_json:
                    data = {
                        "type": "snapshot",
                        **snapshot_to_json(snapshot.run, list(snapshot.parts)),
                    }
                    stream.write(json.dumps(data, sort_keys=True) + "\n")
                    stream.flush()
                else:
                    renderer.snapshot(snapshot, after_seq)
                continue
            event = item.event
            outcome = _OUTCOMES.get(event.type, outcome)
            if as_json:
                stream.write(json.dumps(event_to_json(event), sort_keys=True) + "\n")
                stream.flush()
            else:
                await renderer.event(event)
    finally:
        renderer.close()
    return 0 if outcome == "completed" else 1


# The word a terminal event's type ends with: run.completed -> completed.
_OUTCOMES: dict[str, str] = {t: t.value.removeprefix("run.") for t in TERMINAL_EVENTS}


async def cmd_watch(args: argparse.Namespace, emit: Emit) -> int:
    """Follow a run until it ends."""
    async with _client(args) as client:
        return await follow(
            client, args.run_id, after_seq=args.after, as_json=args.json, deltas=not args.no_deltas
        )


async def cmd_cancel(args: argparse.Namespace, emit: Emit) -> int:
    """Cancel a run."""
    async with _client(args) as client:
        response = await client.cancel(args.run_id, args.reason)
    run = run_to_dict(response.run)
    status = run["status"]
    if not response.changed:
        text = f"run {run['run_id']} is {status}; nothing to cancel"
    elif status == "cancelled":
        text = f"run {run['run_id']} cancelled"
    else:
        text = f"run {run['run_id']}: cancellation requested; its worker is stopping it"
    emit(args, {**run, "changed": response.changed}, text)
    return 0


def register(sub: Any, common: Any, wrap: Any) -> None:
    """Add `watch` and `cancel` to the CLI's subparsers."""
    watch = sub.add_parser("watch", help="follow a run live until it ends")
    watch.add_argument("run_id")
    watch.add_argument(
        "--after", type=int, default=0, metavar="SEQ", help="resume after this event seq"
    )
    watch.add_argument("--no-deltas", action="store_true", help="skip live text deltas")
    common(watch)
    watch.set_defaults(func=wrap(cmd_watch))

    cancel = sub.add_parser("cancel", help="cancel a run")
    cancel.add_argument("run_id")
    cancel.add_argument("--reason", default="", help="why (kept on the run)")
    common(cancel)
    cancel.set_defaults(func=wrap(cmd_cancel))


def add_follow_flag(send: argparse.ArgumentParser) -> None:
    """`tether send --follow`."""
    send.add_argument("--follow", action="store_true", help="render the run live until it ends")
