"""`tether schedules add|list|pause|resume|rm`: the tenant's schedules, each tick of whose cron
admits a run of its agent. `list` shows each one's next fire time."""

from __future__ import annotations

import argparse
from typing import Any

from google.protobuf import json_format

from tether.client import TetherClient
from tether.v1 import common_pb2, gateway_pb2

Emit = Any


def _client(args: argparse.Namespace) -> TetherClient:
    return TetherClient.from_env(getattr(args, "stack", None))


def _dict(message: Any) -> dict[str, Any]:
    data: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return data


def _duration(text: str) -> int:
    """Seconds from `90`, `90s`, `15m`, `6h` or `2d`."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86_400}
    number, unit = (text[:-1], text[-1]) if text[-1:] in units else (text, "s")
    if not number.isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration; write e.g. 90s, 15m, 6h or 2d"
        )
    return int(number) * units[unit]


def _line(found: common_pb2.Schedule) -> str:
    when = (
        "paused"
        if found.paused
        else "next " + found.next_fire_at.ToDatetime().isoformat(timespec="seconds") + "Z"
    )
    return (
        f"{found.schedule_id}  {found.agent}  {found.cron!r} {found.timezone}  {when}  "
        f"overlap={found.overlap} catch-up={found.catch_up}"
    )


async def cmd_add(args: argparse.Namespace, emit: Emit) -> int:
    """Add a schedule; its first fire time is printed."""
    request = gateway_pb2.AddScheduleRequest(
        agent=args.agent,
        cron=args.cron,
        timezone=args.timezone,
        message=args.message,
        overlap=args.overlap,
        catch_up=args.catch_up,
        catch_up_window_seconds=args.catch_up_window,
    )
    async with _client(args) as client:
        added = await client.stub.AddSchedule(request, metadata=client.metadata)
    emit(args, _dict(added.schedule), f"schedule added: {_line(added.schedule)}")
    return 0


async def cmd_list(args: argparse.Namespace, emit: Emit) -> int:
    """List the tenant's schedules, each with its next fire time."""
    async with _client(args) as client:
        listed = await client.stub.ListSchedules(
            gateway_pb2.ListSchedulesRequest(), metadata=client.metadata
        )
    for found in listed.schedules:
        emit(args, _dict(found), _line(found))
    return 0


async def cmd_pause(args: argparse.Namespace, emit: Emit) -> int:
    """Pause a schedule's ticks."""
    async with _client(args) as client:
        moved = await client.stub.PauseSchedule(
            gateway_pb2.PauseScheduleRequest(schedule_id=args.schedule_id),
            metadata=client.metadata,
        )
    emit(args, _dict(moved.schedule), _line(moved.schedule))
    return 0


async def cmd_resume(args: argparse.Namespace, emit: Emit) -> int:
    """Resume a paused schedule from its next tick (the ticks it was paused over are not
    caught up)."""
    async with _client(args) as client:
        moved = await client.stub.ResumeSchedule(
            gateway_pb2.ResumeScheduleRequest(schedule_id=args.schedule_id),
            metadata=client.metadata,
        )
    emit(args, _dict(moved.schedule), _line(moved.schedule))
    return 0


async def cmd_rm(args: argparse.Namespace, emit: Emit) -> int:
    """Remove a schedule (the runs it admitted stay)."""
    async with _client(args) as client:
        await client.stub.RemoveSchedule(
            gateway_pb2.RemoveScheduleRequest(schedule_id=args.schedule_id),
            metadata=client.metadata,
        )
    emit(args, {"schedule_id": args.schedule_id, "removed": True}, "removed")
    return 0


def register(sub: Any, common: Any, wrap: Any) -> None:
    """Add `schedules` and its commands to the CLI's subparsers."""
    schedules = sub.add_parser("schedules", help="runs started on a cron schedule")
    schedules_sub = schedules.add_subparsers(dest="schedules_command", required=True)
    add = schedules_sub.add_parser("add", help="add a schedule")
    add.add_argument("--agent", required=True, help="the agent each tick's run is routed to")
    add.add_argument(
        "--cron", required=True, help="five fields: minute hour day-of-month month day-of-week"
    )
    add.add_argument("--timezone", default="UTC", help="IANA timezone, e.g. Europe/Paris")
    add.add_argument("--message", required=True, help="what each tick's run is asked")
    add.add_argument(
        "--overlap",
        default="skip",
        help="skip (default: no tick while the previous tick's run is active) or allow",
    )
    add.add_argument(
        "--catch-up",
        default="latest",
        help="after an outage: latest (default: one run for the most recent missed tick), "
        "none, or all (every missed tick within --catch-up-window)",
    )
    add.add_argument(
        "--catch-up-window",
        type=_duration,
        default=0,
        metavar="DURATION",
        help="how far back `all` catches up, e.g. 6h (default 1h, at most 7d)",
    )
    listed = schedules_sub.add_parser("list", help="list schedules with their next fire time")
    pause = schedules_sub.add_parser("pause", help="pause a schedule")
    pause.add_argument("schedule_id")
    resume = schedules_sub.add_parser("resume", help="resume a paused schedule")
    resume.add_argument("schedule_id")
    rm = schedules_sub.add_parser("rm", help="remove a schedule")
    rm.add_argument("schedule_id")
    for command, func in (
        (add, cmd_add),
        (listed, cmd_list),
        (pause, cmd_pause),
        (resume, cmd_resume),
        (rm, cmd_rm),
    ):
        common(command)
        command.set_defaults(func=wrap(func))
