"""`tether up`'s supervisor: a service process that dies is started again, on its own ports;
so are the embedded PostgreSQL (on its socket) and Redis (on its port, with its users): the
services reconnect by themselves.

A thread per child blocks in `Popen.wait` and wakes the supervisor the moment the child exits,
so nothing polls. Any exit the supervisor did not ask for (an exit code, a signal, SIGKILL
included) is logged with what ended the process and when it will start again; the restart
waits an exponential backoff (`RetryPolicy` without jitter: 0.5 s doubling to 10 s by default),
back to the shortest wait once a process had stayed up `stable_after_s`. A restart keeps the
instance's name and ports (`ServiceSet.restart`), so the services that call it need not change.
`stop()` ends supervision before anything is stopped on purpose: no restart during shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import subprocess
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from tether.retry import RetryPolicy
from tether.stack.processes import ServiceProcess, ServiceSet

log = logging.getLogger(__name__)


def describe_exit(code: int) -> str:
    """How a process ended, from its `Popen.returncode` (negative: killed by that signal)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


async def exited(process: subprocess.Popen[bytes]) -> int:
    """Wait until `process` exits; returns its exit code. A thread of its own blocks in
    waitpid (portable, and it takes no thread from the loop's default executor)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()

    def settle(code: int) -> None:
        if not done.done():  # the waiter may have been cancelled meanwhile
            done.set_result(code)

    def wait() -> None:
        code = process.wait()
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, code)

    threading.Thread(target=wait, name=f"wait-{process.pid}", daemon=True).start()
    return await done


@dataclass
class RestartBackoff:
    """How long one instance waits before each restart: the policy's backoff by the deaths
    since it last stayed up `stable_after_s` (a start that fails counts as a death)."""

    policy: RetryPolicy
    stable_after_s: float
    deaths: int = 0

    def died(self, uptime_s: float) -> float:
        """The wait before the restart that follows a death after `uptime_s` seconds up."""
        if uptime_s >= self.stable_after_s:
            self.deaths = 0
        delay = self.policy.backoff(self.deaths)
        self.deaths += 1
        return delay


class ServiceSupervisor:
    """Restarts the processes of a `ServiceSet` that die; `start()` then `stop()`."""

    def __init__(
        self,
        services: ServiceSet,
        *,
        backoff: RetryPolicy,
        stable_after_s: float,
        on_restart: Callable[[ServiceProcess], None] | None = None,
    ) -> None:
        self._services = services
        self._backoff = backoff
        self._stable_after_s = stable_after_s
        self._on_restart = on_restart
        self._tasks: list[asyncio.Task[None]] = []
        self.failed = asyncio.Event()
        """Set when supervision itself broke (a bug, logged): the stack should stop."""
        self.error: BaseException | None = None
        """What broke it."""

    def start(self) -> None:
        """Watch every process the set runs now."""
        for instance in self._services.procs:
            self.supervise(
                instance,
                functools.partial(self._process_of, instance),
                functools.partial(self._restart_service, instance),
            )

    def supervise(
        self,
        name: str,
        current: Callable[[], subprocess.Popen[bytes]],
        restart: Callable[[], Awaitable[object]],
    ) -> None:
        """Watch one more process (a backing server: PostgreSQL, Redis): `current` gives the
        running one, `restart` starts it again (raising RuntimeError or TimeoutError when it
        cannot)."""
        task = asyncio.create_task(
            self._supervise(name, current, restart), name=f"supervise-{name}"
        )
        task.add_done_callback(self._died)
        self._tasks.append(task)

    def _process_of(self, instance: str) -> subprocess.Popen[bytes]:
        return self._services.procs[instance].process

    async def _restart_service(self, instance: str) -> None:
        restarted = await self._services.restart(instance)
        log.info("%s restarted: pid %d on %s", instance, restarted.process.pid, restarted.address)
        if self._on_restart is not None:
            self._on_restart(restarted)

    async def stop(self) -> None:
        """Stop watching (and any restart under way, whose process is then killed)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    def _died(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.error = task.exception()
            log.error("%s stopped", task.get_name(), exc_info=self.error)
            self.failed.set()

    async def _supervise(
        self,
        instance: str,
        current: Callable[[], subprocess.Popen[bytes]],
        restart: Callable[[], Awaitable[object]],
    ) -> None:
        loop = asyncio.get_running_loop()
        backoff = RestartBackoff(self._backoff, self._stable_after_s)
        while True:
            process = current()
            up_since = loop.time()
            code = await exited(process)
            uptime = loop.time() - up_since
            delay = backoff.died(uptime)
            log.warning(
                "%s (pid %d) %s after %.1f s; restarting in %.1f s",
                instance,
                process.pid,
                describe_exit(code),
                uptime,
                delay,
            )
            while True:
                await asyncio.sleep(delay)
                try:
                    await restart()
                    break
                except (RuntimeError, TimeoutError, grpc.aio.AioRpcError) as exc:
                    delay = backoff.died(0.0)
                    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    log.warning(
                        "%s did not start again (%s); restarting in %.1f s",
                        instance,
                        reason,
                        delay,
                    )
