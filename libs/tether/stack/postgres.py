"""PostgreSQL as `tether up` runs it: the pgserver wheel's own `postgres` binary started as a
child process, not through `pg_ctl` (whose server is nobody's child), so the supervisor sees
the postmaster die the moment it does and starts it again on the same socket: every URL the
services hold still works."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pwd
import signal
import stat
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

# PostgreSQL refuses to run as root; as root the server runs as the user pgserver makes for it,
# so a data folder pgserver initialised before keeps its owner.
SYSTEM_USER = "pgserver"
SUPERUSER = "postgres"
# A fast shutdown rolls back open transactions and checkpoints; a server still up past this
# is killed (crash recovery at the next start, nothing committed is lost).
STOP_GRACE_S = 30.0


def _pgserver() -> tuple[Path, ModuleType, type[Any]]:
    """pgserver's binaries folder, its utils module and its server class, imported quietly."""
    with warnings.catch_warnings():
        # pgserver asks platformdirs for a runtime dir at import; without XDG_RUNTIME_DIR
        # (containers, CI) it falls back to /tmp with a warning that says nothing useful.
        warnings.simplefilter("ignore")
        from pgserver import _commands, postgres_server, utils

    return _commands.POSTGRES_BIN_PATH, utils, postgres_server.PostgresServer


def binaries() -> Path:
    """The folder of the embedded server's programs (postgres, pg_waldump, ...): a tool that
    reads the server's files uses the same version that wrote them."""
    return _pgserver()[0]


@dataclass
class ChildPostgres:
    """PostgreSQL with its data in `data_dir`, reachable on a Unix socket, run as a child."""

    data_dir: Path
    _process: subprocess.Popen[bytes] | None = None
    _socket_dir: Path | None = None
    _owner: pwd.struct_passwd | None = None

    @property
    def process(self) -> subprocess.Popen[bytes]:
        """The running postmaster."""
        assert self._process is not None, "start() first"
        return self._process

    @property
    def url(self) -> str:
        """A URL to its `postgres` database (the form pgserver gives)."""
        assert self._socket_dir is not None, "start() first"
        return f"postgresql://{SUPERUSER}:@/{SUPERUSER}?host={self._socket_dir}"

    @property
    def log_path(self) -> Path:
        """Where the server logs (where pgserver has it log)."""
        return self.data_dir / "log"

    async def start(self, *, timeout: float = 60.0) -> str:
        """Start the server (initialising the folder the first time) and wait until it accepts
        connections; returns `url`. Raises RuntimeError when it exits first, TimeoutError when
        it is not ready in `timeout` seconds (then it is killed)."""
        if self._socket_dir is None:
            await asyncio.to_thread(self._prepare)
        assert self._socket_dir is not None
        bin_path, utils, _ = _pgserver()
        if self._owner is not None:
            # Again at every start: a folder above may have lost them since (a tool that
            # keeps its own folder owner-only, pytest's among them), and the server, started
            # as another user, then could not reach its data.
            utils.ensure_prefix_permissions(self.data_dir)
        command = [
            str(bin_path / "postgres"),
            "-D",
            str(self.data_dir),
            "-k",
            str(self._socket_dir),
            "-h",
            "",  # no TCP: the socket only, as pgserver starts it
        ]
        with self.log_path.open("ab") as output:
            self._process = subprocess.Popen(
                self._as_owner(command),
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=output,
                start_new_session=True,  # Ctrl-C in a terminal reaches the supervisor only
            )
        try:
            await self._ready(self._process, timeout)
        except TimeoutError:
            self._process.kill()
            await asyncio.to_thread(self._process.wait)
            raise
        return self.url

    def _as_owner(self, command: list[str]) -> list[str]:
        """`command` run as the data folder's owner: through setpriv, which execs it (the pid
        is the server's own) and needs no fork of this process, which holds gRPC's threads."""
        if self._owner is None:
            return command
        return [
            "setpriv",
            f"--reuid={self._owner.pw_uid}",
            f"--regid={self._owner.pw_gid}",
            "--init-groups",
            "--",
            *command,
        ]

    def _prepare(self) -> None:
        """What pgserver does before its first start: the system user and the permissions it
        needs (as root), initdb for a new folder; and a server left running on this folder (a
        `tether up` killed outright, or pgserver's) is stopped, so the one started is ours."""
        bin_path, utils, server_class = _pgserver()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            self._owner = utils.ensure_user_exists(SYSTEM_USER)
            utils.ensure_prefix_permissions(self.data_dir)
            utils.ensure_prefix_permissions(bin_path)
            readable = stat.S_IRGRP | stat.S_IROTH
            utils.ensure_folder_permissions(bin_path, readable | stat.S_IXGRP | stat.S_IXOTH)
            utils.ensure_folder_permissions(bin_path.parent / "lib", readable)
            assert self._owner is not None
            os.chown(self.data_dir, self._owner.pw_uid, self._owner.pw_gid)
        if not (self.data_dir / "PG_VERSION").exists():
            self._run(
                bin_path / "initdb",
                "-D",
                str(self.data_dir),
                "--auth=trust",
                "--auth-local=trust",
                "--encoding=utf8",
                "-U",
                SUPERUSER,
            )
        left = utils.PostmasterInfo.read_from_pgdata(self.data_dir)
        if left is not None and left.is_running():
            log.warning(
                "stopping the PostgreSQL (pid %d) left running on %s", left.pid, self.data_dir
            )
            self._run(bin_path / "pg_ctl", "-D", str(self.data_dir), "-m", "fast", "-w", "stop")
        socket_dir: Path = utils.find_suitable_socket_dir(self.data_dir, server_class.runtime_path)
        if self._owner is not None and socket_dir != self.data_dir:
            utils.ensure_prefix_permissions(socket_dir)
            socket_dir.chmod(0o777)
        self._socket_dir = socket_dir

    def _run(self, program: Path, *args: str) -> None:
        """Run one of pgserver's tools as the folder's owner. Its output is captured, not sent
        to the log: initdb wants an empty folder, and the log is in it."""
        done = subprocess.run(
            self._as_owner([str(program), *args]),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=120,  # initdb on a loaded machine
            check=False,
        )
        if done.returncode != 0:
            said = (done.stderr or done.stdout).decode(errors="replace").strip()
            raise RuntimeError(f"{program.name} exited with {done.returncode}: {said}")

    async def _ready(self, process: subprocess.Popen[bytes], timeout: float) -> None:
        """Wait until postmaster.pid names `process` as ready (what `pg_ctl -w` waits for)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        lock_file = self.data_dir / "postmaster.pid"
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"postgres exited with {process.returncode} before it was ready: "
                    f"{self._last_log_line()}"
                )
            with contextlib.suppress(OSError):
                lines = lock_file.read_text().splitlines()
                # Line 1 is the postmaster's pid, line 8 its status (PostgreSQL's pidfile.h).
                ours = len(lines) >= 8 and lines[0].strip() == str(process.pid)
                if ours and lines[7].strip() == "ready":
                    return
            if loop.time() > deadline:
                raise TimeoutError(f"postgres was not ready within {timeout}s")
            await asyncio.sleep(0.02)  # the lock file is the only readiness signal it gives

    def _last_log_line(self) -> str:
        with contextlib.suppress(OSError):
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
            if lines:
                return lines[-1]
        return f"see {self.log_path}"

    def stop(self) -> None:
        """Fast shutdown (SIGINT to the postmaster), killed if it lasts past STOP_GRACE_S."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGINT)
        try:
            process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            log.warning(
                "PostgreSQL (pid %d) did not stop in %.0f s; killed", process.pid, STOP_GRACE_S
            )
            process.kill()
            process.wait()
