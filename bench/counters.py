"""Counters read at the servers over a phase: the statements PostgreSQL executed (its statement
log), its transactions and WAL, and the commands Redis ran.

PostgreSQL's statement log is turned on by the bench on its own server (`ALTER SYSTEM` and a
reload), only around the phase it counts, since logging every statement slows the server;
autovacuum is off meanwhile (see SETTINGS).
The phase is delimited in the log by two marker statements run on another database, so the
count is exact whatever the reload's timing: a log file is appended to by one write per
message, so the markers' order in the file is the order in time.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections import Counter
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import redis.asyncio as redis

MARK = "tether-bench-mark"
# Time, pid, database, virtual transaction id: %q leaves the last two out for processes that
# are not client sessions (the checkpointer, autovacuum's launcher).
LINE_PREFIX = "%m [%p] %q%d %v "
# While counting: every statement, each with its session's database and transaction; and no
# autovacuum, whose transactions and WAL come at times of its own, inside a short window or
# after it, and are never in the statement log.
SETTINGS = {"log_statement": "all", "log_line_prefix": LINE_PREFIX, "autovacuum": "off"}
RELOAD_WAIT_S = 10.0
_ENTRY = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \S+ \[(?P<pid>\d+)\] "
    r"(?:(?P<database>\S*) (?P<vxid>\S*) )?(?P<level>[A-Z]+\d?):  (?P<message>.*)$"
)
_EXECUTE = re.compile(r"^execute (?:fetch from )?\S+: (?P<text>.*)$", re.DOTALL)
_NAMED = re.compile(r'\b(?:FROM|INTO|UPDATE|JOIN)\s+"?(\w+)"?', re.IGNORECASE)
_CTE = re.compile(r"(\w+)\s+AS\s*\(", re.IGNORECASE)


@dataclass(frozen=True)
class Entry:
    """One message of the server's log, its continuation lines joined."""

    pid: int
    database: str
    vxid: str
    level: str
    message: str


def entries(lines: Iterable[str]) -> Iterator[Entry]:
    """The log's messages: a line with the prefix starts one, a line that begins with a tab
    continues it (PostgreSQL indents a multi-line message so)."""
    current: dict[str, Any] | None = None
    for line in lines:
        line = line.rstrip("\n")
        if line.startswith("\t") and current is not None:
            current["message"] += "\n" + line[1:]
            continue
        if current is not None:
            yield Entry(**current)
            current = None
        match = _ENTRY.match(line)
        if match is not None:
            current = {
                "pid": int(match["pid"]),
                "database": match["database"] or "",
                "vxid": match["vxid"] or "",
                "level": match["level"],
                "message": match["message"],
            }
    if current is not None:
        yield Entry(**current)


def statement_text(entry: Entry) -> str | None:
    """The statement a `log_statement` message records (simple or extended protocol), else
    None."""
    if entry.level != "LOG":
        return None
    if entry.message.startswith("statement: "):
        return entry.message.removeprefix("statement: ")
    match = _EXECUTE.match(entry.message)
    return match["text"] if match else None


def kind(text: str) -> str:
    """A statement's first keyword: BEGIN, SELECT, WITH, ..."""
    words = text.split(None, 1)
    return words[0].rstrip(";").upper() if words else ""


def shape(text: str, tables: Collection[str]) -> str:
    """What a statement does, without its column lists and values: its first keyword, for a
    WITH its common table expressions' names, and the `tables` it names, in order."""
    named = [t for t in dict.fromkeys(_NAMED.findall(text)) if t in tables]
    head = kind(text)
    if head == "WITH":
        head += " " + ",".join(dict.fromkeys(_CTE.findall(text)))
    return f"{head}: {','.join(named)}" if named else head


@dataclass
class Statements:
    """The statements one database's sessions ran between two markers."""

    texts: list[str]
    transactions: int  # distinct virtual transaction ids among them
    errors: int  # ERROR messages of that database in the window
    tables: Collection[str] = ()  # the table names a shape lists

    @property
    def by_kind(self) -> Counter[str]:
        return Counter(kind(t) for t in self.texts)

    @property
    def by_shape(self) -> Counter[str]:
        return Counter(shape(t, self.tables) for t in self.texts)

    @property
    def multi_statement(self) -> int:
        """Messages holding more than one statement (a simple query with `;` inside): each is
        counted once."""
        return sum(1 for t in self.texts if ";" in t.rstrip().rstrip(";"))


def window(
    lines: Iterable[str],
    database: str,
    start_mark: str,
    end_mark: str,
    tables: Collection[str] = (),
) -> Statements:
    """The statements of `database` logged after the message holding `start_mark` and
    before the one holding `end_mark` (their shapes naming `tables`)."""
    texts: list[str] = []
    vxids: set[tuple[int, str]] = set()
    errors = 0
    inside = seen_end = False
    for entry in entries(lines):
        if start_mark in entry.message and statement_text(entry) is not None:
            inside = True
            continue
        if end_mark in entry.message and statement_text(entry) is not None:
            seen_end = True
            break
        if not inside or entry.database != database:
            continue
        text = statement_text(entry)
        if text is not None:
            texts.append(text)
            vxids.add((entry.pid, entry.vxid))
        elif entry.level == "ERROR":
            errors += 1
    if not (inside and seen_end):
        raise RuntimeError(f"markers {start_mark!r} / {end_mark!r} not both in the log")
    return Statements(texts, len(vxids), errors, tables)


@dataclass
class StatementLog:
    """The statement log of a server the bench owns. `admin` is a superuser connection to
    another database than the one counted; `path` is the server's stderr log file."""

    admin: asyncpg.Connection
    path: Path
    tables: Collection[str] = ()  # the table names statement shapes list

    async def _set(self, counting: bool) -> None:
        for setting, value in SETTINGS.items():
            if counting:
                await self.admin.execute(f"ALTER SYSTEM SET {setting} = '{value}'")
            else:
                await self.admin.execute(f"ALTER SYSTEM RESET {setting}")
        await self.admin.execute("SELECT pg_reload_conf()")

    async def enable(self) -> None:
        """Log every statement from now on (each backend from its next command), with no
        autovacuum. Returns once the settings are in force: pg_reload_conf() only signals the
        server, which re-reads its files and signals every backend after it returns; once this
        session sees them, every backend was signalled, and each takes them at its next command
        (before, a loaded machine let a marker run unlogged)."""
        await self._set(True)
        deadline = asyncio.get_running_loop().time() + RELOAD_WAIT_S
        while await self.admin.fetchval("SELECT current_setting('log_statement')") != "all":
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"the server did not reload within {RELOAD_WAIT_S} s")
            await asyncio.sleep(0.01)  # polling the setting until the reload reached us

    async def disable(self) -> None:
        """Back to the server's defaults."""
        await self._set(False)

    async def mark(self, label: str) -> str:
        """Run a marker statement and return its unique text."""
        marker = f"{MARK} {label} {uuid.uuid4().hex}"
        await self.admin.execute(f"SELECT '{marker}'")
        return marker

    def between(self, database: str, start_mark: str, end_mark: str) -> Statements:
        """The statements `database` ran between two markers."""
        with self.path.open(errors="replace") as lines:
            return window(lines, database, start_mark, end_mark, self.tables)


@dataclass(frozen=True)
class PgCounters:
    """Transactions of one database and the server's WAL position, at one moment."""

    xact_commit: int
    xact_rollback: int
    sessions: int  # connections opened to the database so far
    wal_lsn: str
    wal_records: int
    wal_fpi: int

    @property
    def xacts(self) -> int:
        return self.xact_commit + self.xact_rollback


async def pg_counters(admin: asyncpg.Connection, database: str) -> PgCounters:
    """`database`'s committed and rolled-back transactions as the statistics hold them (each
    backend flushes its own at most once a second, or within 10 s once idle), and the WAL."""
    row = await admin.fetchrow(
        "SELECT d.xact_commit, d.xact_rollback, d.sessions, pg_current_wal_lsn()::text AS lsn, "
        "w.wal_records, w.wal_fpi FROM pg_stat_database d, pg_stat_wal w WHERE d.datname = $1",
        database,
    )
    if row is None:
        raise RuntimeError(f"no statistics for database {database!r}")
    return PgCounters(
        row["xact_commit"],
        row["xact_rollback"],
        row["sessions"],
        row["lsn"],
        row["wal_records"],
        row["wal_fpi"],
    )


async def wal_bytes(admin: asyncpg.Connection, before: PgCounters, after: PgCounters) -> int:
    """WAL bytes written between two readings."""
    diff = await admin.fetchval(
        "SELECT pg_wal_lsn_diff($1::text::pg_lsn, $2::text::pg_lsn)",
        after.wal_lsn,
        before.wal_lsn,
    )
    return int(diff)


async def redis_calls(client: redis.Redis) -> Counter[str]:
    """Calls per command Redis has run since it started (INFO commandstats); reading them is
    itself one `info` call, counted in the next reading."""
    info = await client.info("commandstats")
    return Counter(
        {name.removeprefix("cmdstat_"): int(stats["calls"]) for name, stats in info.items()}
    )
