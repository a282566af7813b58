"""Each kustomization under deploy/k8s renders with `kubectl kustomize` and validates strictly
against the Kubernetes schemas (kubernetes-validate --strict); the prod overlay gives every
service the mutual-TLS role its code asks for, with its own certificate; the dev overlay runs
PostgreSQL, Redis and the demo model in the cluster, and its secrets script makes every Secret
it reads, consistently."""

from __future__ import annotations

import ast
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.k8s_support import (
    K8S,
    OVERLAYS,
    SERVICES,
    Rendered,
    containers,
    kubectl,
    rendered_text,
    secret_refs,
    secret_volumes,
)
from tether.credentials import parse_verifiers
from tether.runtime import tls
from tether.stack.embedded import WORKER_REDIS_RULES, WORKER_REDIS_USER

ROOT = K8S.parents[1]
TARGETS = ("base", *(f"overlays/{name}" for name in OVERLAYS))
# The oldest release the manifests are meant for (native gRPC probes are GA from 1.27; 1.29 is
# about the oldest the managed offerings still run) and the newest whose schemas are bundled.
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
TLS_MOUNT = "/etc/tether/tls"
BACKING = ("postgres", "redis", "model")


def kubernetes_validate() -> str:
    found = Path(sys.executable).with_name("kubernetes-validate")
    if not found.exists():
        pytest.fail(f"{found} is missing: install requirements.lock (make venv)")
    return str(found)


def test_kubectl_is_on_the_path() -> None:
    # Says so and fails (never skips) where it is missing: every check here needs it.
    assert Path(kubectl()).is_file()


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("target", TARGETS)
def test_renders_and_validates_strictly(target: str, version: str, tmp_path: Path) -> None:
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(rendered_text(target))
    done = subprocess.run(
        [kubernetes_validate(), "--strict", "--quiet", "-k", version, str(manifest)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    count = len([d for d in yaml.safe_load_all(manifest.read_text()) if d])
    assert count >= 20, f"{target}: only {count} objects rendered"


# -- prod: mutual TLS ------------------------------------------------------------------------


def tls_role(service: str) -> dict[str, bool]:
    """The mutual-TLS role a service's main() asks for: `mutual_tls(..., serves=, calls=)`."""
    tree = ast.parse((ROOT / "services" / service / "main.py").read_text())
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "mutual_tls"
    ]
    assert len(calls) == 1, f"{service}: main() should build its TLS once"
    role = {k.arg: k.value.value for k in calls[0].keywords if isinstance(k.value, ast.Constant)}
    assert set(role) == {"serves", "calls"}, service
    return {str(k): bool(v) for k, v in role.items()}


@pytest.fixture(scope="module")
def prod() -> Rendered:
    return Rendered.of("overlays/prod")


@pytest.mark.parametrize("service", SERVICES)
def test_prod_gives_each_service_its_own_certificate_for_its_role(
    prod: Rendered, service: str
) -> None:
    role = tls_role(service)
    env = {e["name"]: e.get("value") for e in prod.container(service).get("env", [])}
    expected = {tls.CA_ENV: f"{TLS_MOUNT}/ca.crt"}
    if role["serves"]:
        expected[tls.SERVER_CERT_ENV] = f"{TLS_MOUNT}/tls.crt"
        expected[tls.SERVER_KEY_ENV] = f"{TLS_MOUNT}/tls.key"
    if role["calls"]:
        expected[tls.CLIENT_CERT_ENV] = f"{TLS_MOUNT}/tls.crt"
        expected[tls.CLIENT_KEY_ENV] = f"{TLS_MOUNT}/tls.key"
    assert {k: v for k, v in env.items() if k.startswith("TETHER_TLS_")} == expected
    pod = prod.deployment(service)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == f"tether-{service}-tls", "its own, no one else's"
    assert volume["secret"]["defaultMode"] == 0o440, "the key readable by the pod's group only"
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    (mount,) = [m for m in prod.container(service)["volumeMounts"] if m["name"] == volume["name"]]
    assert (mount["mountPath"], mount.get("readOnly")) == (TLS_MOUNT, True)


def test_every_server_of_internal_calls_serves_tls(prod: Rendered) -> None:
    servers = {s for s in SERVICES if tls_role(s)["serves"]}
    assert servers == {"admission", "orchestrator", "interactions"}
    for service in servers:
        (port,) = prod.objects("Service")[service]["spec"]["ports"]
        assert port.get("appProtocol") != "kubernetes.io/h2c", f"{service} is not cleartext"


def test_prod_runs_no_database_in_the_cluster(prod: Rendered) -> None:
    assert not {w["metadata"]["name"] for w in prod.workloads()} & set(BACKING)


def test_prod_example_secrets_cover_what_it_reads_with_placeholders_only(prod: Rendered) -> None:
    examples = {
        d["metadata"]["name"]: d
        for d in _docs((K8S / "overlays/prod/secrets.example.yaml").read_text())
    }
    read: dict[str, set[str]] = {}
    for workload in prod.workloads():
        for ref in secret_refs(workload).values():
            if not ref.get("optional"):
                read.setdefault(ref["name"], set()).add(ref["key"])
        for name in secret_volumes(workload):
            read.setdefault(name, set()).update({"tls.crt", "tls.key", "ca.crt"})
    assert set(examples) == set(read)
    for name, doc in examples.items():
        assert doc["kind"] == "Secret" and "data" not in doc
        assert read[name] <= set(doc["stringData"]), name
        for key, value in doc["stringData"].items():
            assert "CHANGE-ME" in value, f"{name}.{key} looks like a real value"


# -- dev: everything in the cluster ----------------------------------------------------------


@pytest.fixture(scope="module")
def dev() -> Rendered:
    return Rendered.of("overlays/dev")


def test_dev_runs_postgres_redis_and_the_demo_model_once_each(dev: Rendered) -> None:
    workloads = {w["metadata"]["name"]: w for w in dev.workloads()}
    for name in BACKING:
        assert workloads[name]["spec"]["replicas"] == 1, name
        assert name in dev.objects("Service"), name
    (model,) = workloads["model"]["spec"]["template"]["spec"]["containers"]
    assert model["command"][:3] == ["python", "-m", "tether.testing.model_server"]


def test_dev_redis_makes_the_workers_publish_only_user_as_tether_up_does(dev: Rendered) -> None:
    (redis,) = {w["metadata"]["name"]: w for w in dev.workloads()}["redis"]["spec"]["template"][
        "spec"
    ]["containers"]
    command = redis["command"]
    user = command[command.index("--user") + 1 :]
    user = user[: next((i for i, w in enumerate(user) if w.startswith("--")), len(user))]
    assert user[:4] == [WORKER_REDIS_USER, "reset", "on", ">$(WORKER_REDIS_PASSWORD)"]
    assert tuple(user[4:]) == WORKER_REDIS_RULES


def run_dev_secrets(tmp_path: Path, **env: str) -> dict[str, dict[str, str]]:
    """Run secrets.sh against a kubectl that records what it is asked to create (no Secret
    exists yet); returns name -> key -> value."""
    calls = tmp_path / "calls"
    stub = tmp_path / "bin" / "kubectl"
    stub.parent.mkdir()
    stub.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\0" "$@" >> "{calls}"\n'
        f'printf "\\n" >> "{calls}"\n'
        # `get` finds nothing; everything else succeeds.
        'for arg in "$@"; do [ "$arg" = get ] && exit 1; done\n'
        "exit 0\n"
    )
    stub.chmod(0o755)
    script = K8S / "overlays/dev/secrets.sh"
    done = subprocess.run(
        ["bash", str(script)],
        env={"PATH": os.environ["PATH"], "KUBECTL": str(stub), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    made: dict[str, dict[str, str]] = {}
    for line in calls.read_text().split("\n"):
        words = [w for w in line.split("\0") if w]
        if words[2:5] == ["create", "secret", "generic"]:
            literals = [w.removeprefix("--from-literal=") for w in words[6:]]
            made[words[5]] = dict(w.split("=", 1) for w in literals)
    made["__stdout__"] = {"text": done.stdout}
    return made


def test_dev_secrets_script_makes_every_secret_the_overlay_reads(
    dev: Rendered, tmp_path: Path
) -> None:
    made = run_dev_secrets(tmp_path)
    for workload in dev.workloads():
        for env, ref in secret_refs(workload).items():
            if ref.get("optional"):
                continue
            assert ref["key"] in made.get(ref["name"], {}), f"{workload['metadata']['name']}: {env}"
    assert not any(secret_volumes(w) for w in dev.workloads()), "no certificates in dev"

    # The URLs carry the passwords PostgreSQL and Redis were given.
    postgres = made["tether-dev-postgres"]["POSTGRES_PASSWORD"]
    assert f":{postgres}@postgres.tether.svc" in made["tether-database"]["TETHER_DATABASE_URL"]
    redis = made["tether-dev-redis"]["REDIS_PASSWORD"]
    assert f":{redis}@redis.tether.svc" in made["tether-redis"]["TETHER_REDIS_URL"]
    worker_redis = made["tether-dev-redis"]["WORKER_REDIS_PASSWORD"]
    assert (
        f"//{WORKER_REDIS_USER}:{worker_redis}@redis.tether.svc"
        in made["tether-worker-redis"]["TETHER_REDIS_URL"]
    )
    # The servers' verifiers are the callers' credentials' digests.
    verifiers = parse_verifiers(made["tether-service-verifiers"]["TETHER_SERVICE_VERIFIERS"])
    for caller in ("gateway", "worker", "interactions"):
        secret = made[f"tether-{caller}-credential"]["TETHER_SERVICE_CREDENTIAL"]
        assert verifiers[hashlib.sha256(secret.encode()).hexdigest()] == caller
    # The operator's credential is shown once; the cluster keeps its hash.
    shown = re.search(r"top_[0-9a-f]{64}", made["__stdout__"]["text"])
    assert shown is not None
    digest = made["tether-operator"]["TETHER_GATEWAY_OPERATOR_CREDENTIAL_SHA256"]
    assert hashlib.sha256(shown.group(0).encode()).hexdigest() == digest
    # Without an Anthropic key the worker is pointed at the in-cluster demo model.
    anthropic = made["tether-anthropic"]
    assert anthropic["TETHER_WORKER_ANTHROPIC_BASE_URL"].startswith("http://model.tether.svc")
    fresh = {postgres, redis, worker_redis, *verifiers}
    assert len(fresh) == 3 + len(verifiers), "every value fresh"


def test_dev_secrets_script_uses_a_real_anthropic_key_when_given(tmp_path: Path) -> None:
    made = run_dev_secrets(tmp_path, ANTHROPIC_API_KEY="sk-ant-test")
    assert made["tether-anthropic"] == {"TETHER_WORKER_ANTHROPIC_API_KEY": "sk-ant-test"}


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_no_kustomization_lists_the_secret_examples() -> None:
    for kustomization in K8S.rglob("kustomization.yaml"):
        (doc,) = _docs(kustomization.read_text())
        assert not any("secret" in str(r) for r in doc.get("resources", [])), kustomization
    for workload in Rendered.of("overlays/dev").workloads():
        for container in containers(workload):
            assert "secretRef" not in str(container.get("envFrom", []))
