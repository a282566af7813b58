"""CPU time of processes, read from /proc/<pid>/stat (utime + stime, and for a process whose
children exit while it runs, cutime + cstime: a PostgreSQL backend that ends is added to the
postmaster's children's time when it is reaped)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name, or None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name is in parentheses and may hold spaces or parentheses itself.
    return raw[raw.rindex(")") + 2 :].split()


def cpu_s(pid: int, *, reaped_children: bool = False) -> float:
    """CPU seconds `pid` has used (0.0 once it is gone); with `reaped_children`, plus those
    of its children that have exited and been waited for."""
    fields = stat_fields(pid)
    if fields is None:
        return 0.0
    # After the name: state is field 3 of stat(5), so utime (14) is index 11 here.
    ticks = int(fields[11]) + int(fields[12])
    if reaped_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / TICKS_PER_S


def children(pid: int) -> list[int]:
    """Live direct children of `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = stat_fields(int(entry.name))
            if fields is not None and int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of `pid`, of its live children and of its reaped ones: the whole of a
    server that forks a process per connection (PostgreSQL)."""
    return cpu_s(pid, reaped_children=True) + sum(cpu_s(child) for child in children(pid))


@dataclass(frozen=True)
class Sample:
    """CPU seconds by role at one moment."""

    by_role: dict[str, float]

    def __sub__(self, earlier: Sample) -> Sample:
        return Sample({k: v - earlier.by_role.get(k, 0.0) for k, v in self.by_role.items()})

    @property
    def total(self) -> float:
        return sum(self.by_role.values())


@dataclass
class CpuMeter:
    """Samples the CPU time of named processes: `roles()` says, at each sample, which pids
    play which role (several pids may share one: the workers); a role named in `trees`
    counts its process with all its children, live and reaped."""

    roles: Callable[[], Mapping[str, list[int]]]
    trees: frozenset[str] = frozenset()

    def sample(self) -> Sample:
        """CPU seconds used so far, by role."""
        return Sample(
            {
                role: sum(tree_cpu_s(p) if role in self.trees else cpu_s(p) for p in pids)
                for role, pids in self.roles().items()
            }
        )
