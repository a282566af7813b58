"""The Kubernetes manifests in deploy/k8s hold the production rules they promise.

Each service gets a Deployment, a Service and a disruption budget; every pod is probed over native
gRPC health, runs locked down and drains within its grace; credentials arrive only through
secretKeyRef and the worker never sees the database; ingress follows who calls whom.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
NAMESPACE = "tether"
IMAGE = "ghcr.io/tether/tether"
PORT = 7000
# The gateway alone also serves the HTTP/SSE bridge.
HTTP_PORT = 8080

SERVICES = ("gateway", "admission", "orchestrator", "interactions", "worker")
INTERNAL = ("admission", "orchestrator", "interactions", "worker")
AUTOSCALED = {"gateway": None, "worker": (2, 20)}
# Who dials whom over gRPC; every other ingress is refused.
CALLERS: dict[str, set[str]] = {
    "admission": {"gateway"},
    "orchestrator": {"gateway", "worker", "interactions"},
    "interactions": {"gateway", "worker"},
    "worker": set(),
}
DATABASE_USERS = {"gateway", "admission", "orchestrator", "interactions"}
# Environment variables that carry credentials, and the Secret each must come from.
SECRET_ENV = {
    "TETHER_DATABASE_URL": "tether-database",
    "TETHER_REDIS_URL": "tether-redis",
    "TETHER_SERVICE_VERIFIERS": "tether-service-verifiers",
    "TETHER_GATEWAY_OPERATOR_CREDENTIAL_SHA256": "tether-operator",
    "TETHER_WORKER_ANTHROPIC_API_KEY": "tether-anthropic",
    "TETHER_WORKER_ANTHROPIC_BASE_URL": "tether-anthropic",
}
# Each calling service's own credential, from a Secret no other service reads.
CREDENTIAL_ENV = "TETHER_SERVICE_CREDENTIAL"
CREDENTIAL_HOLDERS = ("gateway", "worker", "interactions")
VERIFIER_HOLDERS = ("admission", "orchestrator", "interactions")


def _credential_secret(service: str) -> str:
    return f"tether-{service}-credential"


MIGRATE = (
    "import asyncio,os; from tether.db.migrate import upgrade; "
    "asyncio.run(upgrade(os.environ['TETHER_DATABASE_URL']))"
)


def _load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


@functools.cache
def _kustomization() -> dict[str, Any]:
    (doc,) = _load(K8S / "kustomization.yaml")
    return doc


@functools.cache
def _resources() -> tuple[dict[str, Any], ...]:
    """Every object the kustomization applies."""
    return tuple(doc for name in _kustomization()["resources"] for doc in _load(K8S / name))


def _objects(kind: str) -> dict[str, dict[str, Any]]:
    found = [doc for doc in _resources() if doc["kind"] == kind]
    by_name = {doc["metadata"]["name"]: doc for doc in found}
    assert len(by_name) == len(found), f"duplicate {kind} names"
    return by_name


def _deployment(service: str) -> dict[str, Any]:
    deployments = _objects("Deployment")
    assert service in deployments, f"no Deployment for {service}"
    return deployments[service]


def _pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return dict(workload["spec"]["template"]["metadata"]["labels"])


def _selects(match_labels: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in match_labels.items())


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def _workloads() -> list[dict[str, Any]]:
    return [doc for doc in _resources() if doc["kind"] in ("Deployment", "Job")]


def _secret_refs(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Env var name -> its secretKeyRef, over every container of the workload."""
    refs = {}
    for container in _containers(workload):
        for entry in container.get("env", []):
            ref = entry.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None:
                refs[entry["name"]] = ref
    return refs


def _config() -> dict[str, str]:
    configmaps = _objects("ConfigMap")
    assert "tether-config" in configmaps
    return configmaps["tether-config"]["data"]


# -- files -----------------------------------------------------------------------------------


def test_every_kustomization_resource_exists_and_parses() -> None:
    resources = _kustomization()["resources"]
    assert resources
    for name in resources:
        path = K8S / name
        assert path.is_file(), f"kustomization lists missing {name}"
        docs = _load(path)
        assert docs, f"{name} holds no object"
        for doc in docs:
            assert doc.get("apiVersion") and doc.get("kind"), f"{name}: not a k8s object"
            assert doc["metadata"]["name"]


def test_every_yaml_file_parses_and_only_the_example_is_left_out() -> None:
    files = {p.name for p in K8S.glob("*.y*ml")}
    listed = set(_kustomization()["resources"])
    assert files - listed == {"kustomization.yaml", "secrets.example.yaml"}
    assert "secrets.example.yaml" not in listed
    for name in files:
        _load(K8S / name)


def test_no_secret_object_is_applied() -> None:
    assert not _objects("Secret"), "Secrets are created out of band, never committed"


def test_example_secrets_hold_only_placeholders() -> None:
    docs = _load(K8S / "secrets.example.yaml")
    credential_secrets = {_credential_secret(s): s for s in CREDENTIAL_HOLDERS}
    assert {doc["metadata"]["name"] for doc in docs} == {
        *SECRET_ENV.values(),
        *credential_secrets,
    }
    for doc in docs:
        assert doc["kind"] == "Secret"
        assert "data" not in doc
        for key, value in doc["stringData"].items():
            if doc["metadata"]["name"] in credential_secrets:
                assert key == CREDENTIAL_ENV
            else:
                assert key in SECRET_ENV and SECRET_ENV[key] == doc["metadata"]["name"]
            assert "CHANGE-ME" in value, f"{key} looks like a real value"


def test_everything_lives_in_the_namespace() -> None:
    assert _kustomization()["namespace"] == NAMESPACE
    assert NAMESPACE in _objects("Namespace")
    for doc in _resources():
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, doc["metadata"]["name"]


# -- per service -----------------------------------------------------------------------------


@pytest.mark.parametrize("service", SERVICES)
def test_service_runs_its_own_module_from_the_one_image(service: str) -> None:
    (container,) = _deployment(service)["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith(IMAGE + ":")
    assert container["command"] == ["python", "-m", f"services.{service}"]
    assert (ROOT / "services" / service / "__main__.py").is_file()
    assert {"name": "grpc", "containerPort": PORT, "protocol": "TCP"} in container["ports"]


@pytest.mark.parametrize("service", SERVICES)
def test_service_has_a_clusterip_service_on_grpc_port(service: str) -> None:
    services = _objects("Service")
    assert service in services, f"no Service for {service}"
    spec = services[service]["spec"]
    assert spec.get("type", "ClusterIP") == "ClusterIP"
    expected = [("grpc", PORT), *([("http", HTTP_PORT)] if service == "gateway" else [])]
    assert [(p["name"], p["port"]) for p in spec["ports"]] == expected
    assert _selects(spec["selector"], _pod_labels(_deployment(service)))


@pytest.mark.parametrize("service", SERVICES)
def test_service_has_a_disruption_budget(service: str) -> None:
    pdbs = [
        pdb
        for pdb in _objects("PodDisruptionBudget").values()
        if _selects(pdb["spec"]["selector"]["matchLabels"], _pod_labels(_deployment(service)))
    ]
    assert len(pdbs) == 1, f"{service}: expected one PodDisruptionBudget"
    spec = pdbs[0]["spec"]
    if service == "worker":
        assert spec.get("maxUnavailable") == 1 and "minAvailable" not in spec
    else:
        assert spec.get("minAvailable") == 1 and "maxUnavailable" not in spec


@pytest.mark.parametrize("service", SERVICES)
def test_replicas_leave_room_for_the_budget(service: str) -> None:
    spec = _deployment(service)["spec"]
    autoscalers = _objects("HorizontalPodAutoscaler").values()
    hpas = {hpa["spec"]["scaleTargetRef"]["name"]: hpa for hpa in autoscalers}
    if service in AUTOSCALED:
        assert "replicas" not in spec, "the autoscaler owns the replica count"
        hpa = hpas[service]
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
        assert hpa["spec"]["minReplicas"] >= 2
        assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
        bounds = AUTOSCALED[service]
        if bounds is not None:
            assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == bounds
    else:
        assert service not in hpas
        assert spec["replicas"] >= 2


@pytest.mark.parametrize("service", SERVICES)
def test_service_has_grpc_probes(service: str) -> None:
    (container,) = _deployment(service)["spec"]["template"]["spec"]["containers"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == PORT, f"{service}: {probe}"
        assert "service" not in container[probe]["grpc"], "probe the server's overall health"


@pytest.mark.parametrize("service", SERVICES)
def test_termination_grace_covers_the_drain(service: str) -> None:
    pod = _deployment(service)["spec"]["template"]["spec"]
    grace = float(_config()[f"TETHER_{service.upper()}_GRACE_S"])
    assert pod["terminationGracePeriodSeconds"] >= grace + 5, "room to clean up before SIGKILL"


def test_worker_gets_the_longest_grace() -> None:
    graces = {
        s: _deployment(s)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        for s in SERVICES
    }
    assert graces["worker"] >= 60
    assert all(graces["worker"] > grace for s, grace in graces.items() if s != "worker")


@pytest.mark.parametrize("service", SERVICES)
def test_service_binds_and_finds_peers_through_the_configmap(service: str) -> None:
    config = _config()
    (container,) = _deployment(service)["spec"]["template"]["spec"]["containers"]
    assert {"configMapRef": {"name": "tether-config"}} in container["envFrom"]
    assert config[f"TETHER_{service.upper()}_HOST"] == "0.0.0.0"
    assert config[f"TETHER_{service.upper()}_PORT"] == str(PORT)
    for peer in ("admission", "orchestrator", "interactions"):
        address = f"{peer}.{NAMESPACE}.svc.cluster.local:{PORT}"
        assert config[f"TETHER_{peer.upper()}_ADDR"] == address
        assert peer in _objects("Service")


# -- security --------------------------------------------------------------------------------


def test_every_pod_is_locked_down_and_sized() -> None:
    for workload in _workloads():
        name = workload["metadata"]["name"]
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod.get("automountServiceAccountToken") is False, name
        for container in _containers(workload):
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["capabilities"]["drop"] == ["ALL"], name
            assert not context["capabilities"].get("add"), name
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][bound]), name


def test_credentials_arrive_only_through_secret_key_refs() -> None:
    assert not set(_config()) & set(SECRET_ENV), "credentials in the ConfigMap"
    for workload in _workloads():
        name = workload["metadata"]["name"]
        for container in _containers(workload):
            for source in container.get("envFrom", []):
                assert "secretRef" not in source, f"{name}: whole-Secret envFrom hides what it gets"
            for entry in container.get("env", []):
                if entry["name"] == CREDENTIAL_ENV:
                    ref = entry["valueFrom"]["secretKeyRef"]
                    assert ref["name"] == _credential_secret(name), f"{name}: another's credential"
                    assert ref["key"] == CREDENTIAL_ENV, name
                elif entry["name"] in SECRET_ENV:
                    assert "value" not in entry, f"{name}: literal {entry['name']}"
                    ref = entry["valueFrom"]["secretKeyRef"]
                    assert ref["name"] == SECRET_ENV[entry["name"]], name
                    assert ref["key"] == entry["name"], name


def test_the_worker_holds_no_database_credentials() -> None:
    worker = _deployment("worker")
    refs = _secret_refs(worker)
    assert "TETHER_DATABASE_URL" not in refs
    assert "TETHER_REDIS_URL" not in refs
    assert not {ref["name"] for ref in refs.values()} & {"tether-database", "tether-redis"}
    for container in _containers(worker):
        names = {entry["name"] for entry in container.get("env", [])}
        assert not names & {"TETHER_DATABASE_URL", "TETHER_REDIS_URL"}
        assert not any("secretRef" in source for source in container.get("envFrom", []))


def test_database_and_model_credentials_go_where_they_are_needed() -> None:
    for service in SERVICES:
        refs = _secret_refs(_deployment(service))
        has_db = refs.get("TETHER_DATABASE_URL", {}).get("name") == "tether-database"
        assert has_db == (service in DATABASE_USERS), service
        uses_anthropic = any(ref["name"] == "tether-anthropic" for ref in refs.values())
        assert uses_anthropic == (service == "worker"), service
    api_key = _secret_refs(_deployment("worker"))["TETHER_WORKER_ANTHROPIC_API_KEY"]
    assert not api_key.get("optional", False)


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_carries_only_its_own_credential_and_its_callers_verifiers(
    service: str,
) -> None:
    refs = _secret_refs(_deployment(service))
    credential = refs.get(CREDENTIAL_ENV)
    assert (credential is not None) == (service in CREDENTIAL_HOLDERS), service
    if credential is not None:
        assert credential["name"] == _credential_secret(service)
        assert not credential.get("optional", False), "a caller must not start without it"
    names = {ref["name"] for ref in refs.values()}
    others = {_credential_secret(s) for s in CREDENTIAL_HOLDERS if s != service}
    assert not names & others, f"{service} can read another service's credential"
    verifiers = refs.get("TETHER_SERVICE_VERIFIERS")
    assert (verifiers is not None) == (service in VERIFIER_HOLDERS), service
    if verifiers is not None:
        assert not verifiers.get("optional", False), "a server must not start without them"
    operator = refs.get("TETHER_GATEWAY_OPERATOR_CREDENTIAL_SHA256")
    assert (operator is not None) == (service == "gateway"), service


def test_migrations_job() -> None:
    jobs = [doc for doc in _resources() if doc["kind"] == "Job"]
    (job,) = jobs
    assert job["apiVersion"] == "batch/v1"
    spec = job["spec"]
    assert spec["backoffLimit"] >= 1
    assert spec["ttlSecondsAfterFinished"] > 0
    assert spec["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")
    (container,) = spec["template"]["spec"]["containers"]
    assert container["image"].startswith(IMAGE + ":")
    assert container["command"] == ["python", "-c", MIGRATE]
    assert _secret_refs(job)["TETHER_DATABASE_URL"]["name"] == "tether-database"


def test_images_share_one_tag() -> None:
    (image,) = _kustomization()["images"]
    assert image["name"] == IMAGE
    tags = {c["image"] for w in _workloads() for c in _containers(w)}
    assert tags == {f"{IMAGE}:{image['newTag']}"}


# -- network policy --------------------------------------------------------------------------


def _ingress_callers(labels: dict[str, str]) -> set[str]:
    """Components allowed to reach pods with `labels`; "*" stands for anything wider."""
    callers: set[str] = set()
    for policy in _objects("NetworkPolicy").values():
        spec = policy["spec"]
        if "Ingress" not in spec["policyTypes"]:
            continue
        if not _selects(spec["podSelector"].get("matchLabels", {}), labels):
            continue
        for rule in spec.get("ingress", []):
            ports = [(p.get("protocol", "TCP"), p["port"]) for p in rule.get("ports", [])]
            allowed = [("TCP", PORT)]
            if labels.get("app.kubernetes.io/component") == "gateway":
                allowed.append(("TCP", HTTP_PORT))
            assert ports == allowed, f"{policy['metadata']['name']}: only the service's ports"
            if "from" not in rule:
                callers.add("*")
            for peer in rule.get("from", []):
                selector = peer.get("podSelector", {}).get("matchLabels", {})
                component = selector.get("app.kubernetes.io/component")
                if set(peer) == {"podSelector"} and component in SERVICES:
                    callers.add(component)
                else:
                    callers.add("*")
    return callers


def test_ingress_is_denied_by_default() -> None:
    denials = [
        p
        for p in _objects("NetworkPolicy").values()
        if p["spec"]["podSelector"] in ({}, {"matchLabels": {}})
        and "Ingress" in p["spec"]["policyTypes"]
        and not p["spec"].get("ingress")
    ]
    assert denials, "no default-deny ingress policy"


def test_gateway_is_open_on_the_grpc_port() -> None:
    assert _ingress_callers(_pod_labels(_deployment("gateway"))) == {"*"}


@pytest.mark.parametrize("service", INTERNAL)
def test_internal_service_admits_only_its_callers(service: str) -> None:
    assert _ingress_callers(_pod_labels(_deployment(service))) == CALLERS[service]


def test_each_internal_service_that_is_called_has_its_own_policy() -> None:
    for service, callers in CALLERS.items():
        if not callers:
            continue
        labels = _pod_labels(_deployment(service))
        own = [
            p
            for p in _objects("NetworkPolicy").values()
            if p["spec"]["podSelector"].get("matchLabels")
            and _selects(p["spec"]["podSelector"]["matchLabels"], labels)
        ]
        assert own, f"no NetworkPolicy for {service}"
