"""The one logging setup of every service: a JSON object a line on stderr (or a readable line
for a terminal), carrying the tenant, run, attempt and trace ids of what the line is about.

What a line is about comes from the task that logs it: `bind_run` names the run for the rest of
the current task (and the tasks it starts, which copy its context), so a worker's attempt, a
Work write and a unary call about a run log with its ids without passing them around. The
trace ids are the current span's while telemetry is on, else those of the trace context the
run was stored with.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, NamedTuple

from tether import telemetry
from tether.telemetry import tracing


class RunFields(NamedTuple):
    """The ids a log line about a run carries (empty or 0 when not known where it logs). A
    tuple: made once per attempt and per write, it must cost next to nothing."""

    run_id: str
    tenant_id: str = ""
    attempt: int = 0
    trace_id: str = ""


_RUN: ContextVar[RunFields | None] = ContextVar("tether_log_run", default=None)


def bind_run(run_id: str, tenant_id: str = "", attempt: int = 0, traceparent: str = "") -> None:
    """Lines logged from here on in this task (and the tasks it starts) are about this run.
    `traceparent`, when the run has one, gives them its trace id while no span is current."""
    # A W3C traceparent is 00-<32 hex trace id>-<16 hex span id>-<2 hex flags>.
    trace_id = traceparent[3:35] if len(traceparent) == 55 else ""
    _RUN.set(RunFields(run_id, tenant_id, attempt, trace_id))


def bound_run() -> RunFields | None:
    """The run this task's lines are about, if one was bound."""
    return _RUN.get()


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, service, logger, message, the run's ids and the
    trace's, and the exception when there is one."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="microseconds"),
            "level": record.levelname,
            "service": self._service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        run = _RUN.get()
        if run is not None:
            line["run_id"] = run.run_id
            if run.tenant_id:
                line["tenant_id"] = run.tenant_id
            if run.attempt:
                line["attempt"] = run.attempt
            if run.trace_id:
                line["trace_id"] = run.trace_id
        if telemetry.on:
            ids = tracing.current_ids()
            if ids is not None:
                line["trace_id"], line["span_id"] = ids
        if record.exc_info and record.exc_info[1] is not None:
            line["exception"] = format_exception(record.exc_info[1])
        return json.dumps(line, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """A readable line: time, service, level, logger, message and the run it is about."""

    def __init__(self, service: str) -> None:
        super().__init__(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")

    def formatException(self, ei: Any) -> str:  # logging's name
        """The exception as `format_exception` renders it."""
        return format_exception(ei[1]) if ei[1] is not None else ""

    def format(self, record: logging.LogRecord) -> str:
        """The record as text, with ` [run RUN_ID]` when it is about one."""
        text = super().format(record)
        run = _RUN.get()
        return text if run is None else f"{text} [run {run.run_id}]"


# Exceptions whose message may quote stored data: the database's own words ("invalid input
# syntax for type integer: ...", a duplicate key's value) and the driver's.
_QUOTING_DATA = ("asyncpg", "sqlalchemy")


def format_exception(exc: BaseException) -> str:
    """`exc` and what it came from, each with its traceback, as Python prints them; but the
    message of a database or driver error is withheld (it may quote what a person wrote) and
    its SQLSTATE given instead: the class name and the code say what went wrong."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        cause = current.__cause__
        current = (
            cause if cause is not None or current.__suppress_context__ else current.__context__
        )
    blocks = []
    for one in reversed(chain):
        kind = type(one)
        said = str(one)
        if kind.__module__.split(".")[0] in _QUOTING_DATA:
            code = getattr(one, "sqlstate", None) or getattr(
                getattr(one, "orig", None), "sqlstate", None
            )
            said = f"(message withheld: it may quote stored data; SQLSTATE {code or 'none'})"
        frames = "".join(traceback.format_tb(one.__traceback__))
        name = f"{kind.__module__}.{kind.__qualname__}"
        blocks.append(f"Traceback (most recent call last):\n{frames}{name}: {said}")
    return "\n\nThe above exception led to:\n\n".join(blocks)


def configure_logging(service: str, level: str, log_format: str = "json") -> None:
    """Every record of the process to stderr as `log_format` (json or text) from `level` up."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if log_format == "json" else TextFormatter(service))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # One line per provider request drowns the service's own story; keep warnings only.
    logging.getLogger("httpx2").setLevel(logging.WARNING)
