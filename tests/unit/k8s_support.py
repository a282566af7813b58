"""The Kubernetes manifests as a cluster would receive them: each kustomization under
deploy/k8s rendered by `kubectl kustomize` (never read file by file, so patches and deletions
count), and helpers over the objects it yields."""

from __future__ import annotations

import functools
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = tuple(sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml")))
# Every service is a folder under services/ with its own entry point.
SERVICES = tuple(sorted(p.parent.name for p in (ROOT / "services").glob("*/__main__.py")))
NAMESPACE = "tether"
IMAGE = "ghcr.io/tether/tether"
PORT = 7000
HEALTH_PORT = 7001
# The gateway alone also serves the HTTP/SSE bridge.
HTTP_PORT = 8080
# terminationGracePeriodSeconds is a service's drain period plus this, for closing its pools
# and channels before SIGKILL.
GRACE_HEADROOM_S = 10


def kubectl() -> str:
    """The kubectl binary (it bundles kustomize), or the test fails saying it is missing: the
    manifests cannot be checked as a cluster receives them without it."""
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail(
            "kubectl is not on PATH: the Kubernetes manifests are checked as `kubectl kustomize` "
            "renders them, so these tests cannot run without it (install kubectl >= 1.27)"
        )
    return found


@functools.cache
def rendered_text(target: str) -> str:
    """`kubectl kustomize deploy/k8s/<target>` (target: `base` or `overlays/<name>`)."""
    done = subprocess.run(
        [kubectl(), "kustomize", str(K8S / target)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"kubectl kustomize deploy/k8s/{target} failed:\n{done.stderr}")
    return done.stdout


@dataclass(frozen=True)
class Rendered:
    """The objects one kustomization renders."""

    name: str
    docs: tuple[dict[str, Any], ...]

    @classmethod
    def of(cls, target: str) -> Rendered:
        docs = tuple(d for d in yaml.safe_load_all(rendered_text(target)) if d is not None)
        return cls(target, docs)

    def objects(self, kind: str) -> dict[str, dict[str, Any]]:
        """Objects of `kind` by name (a duplicate name fails)."""
        found = [doc for doc in self.docs if doc["kind"] == kind]
        by_name = {doc["metadata"]["name"]: doc for doc in found}
        assert len(by_name) == len(found), f"{self.name}: duplicate {kind} names"
        return by_name

    def deployment(self, service: str) -> dict[str, Any]:
        deployments = self.objects("Deployment")
        assert service in deployments, f"{self.name}: no Deployment for {service}"
        return deployments[service]

    def container(self, service: str) -> dict[str, Any]:
        """The one container of a service's pods."""
        (container,) = self.deployment(service)["spec"]["template"]["spec"]["containers"]
        return dict(container)

    def workloads(self) -> list[dict[str, Any]]:
        """Everything that runs pods."""
        kinds = ("Deployment", "StatefulSet", "Job")
        return [doc for doc in self.docs if doc["kind"] in kinds]

    def config(self) -> dict[str, str]:
        configmaps = self.objects("ConfigMap")
        assert "tether-config" in configmaps, f"{self.name}: no tether-config"
        return dict(configmaps["tether-config"]["data"])


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return dict(workload["spec"]["template"]["metadata"]["labels"])


def component(workload: dict[str, Any]) -> str:
    return pod_labels(workload)["app.kubernetes.io/component"]


def selects(match_labels: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in match_labels.items())


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def secret_refs(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Env var name -> its secretKeyRef, over every container of the workload."""
    refs = {}
    for container in containers(workload):
        for entry in container.get("env", []):
            ref = entry.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None:
                refs[entry["name"]] = ref
    return refs


def secret_volumes(workload: dict[str, Any]) -> set[str]:
    """The Secrets a workload mounts as volumes."""
    volumes = workload["spec"]["template"]["spec"].get("volumes", [])
    return {v["secret"]["secretName"] for v in volumes if "secret" in v}
