"""Every overlay under deploy/k8s, as `kubectl kustomize` renders it, holds the production
rules it promises.

Every service under services/ gets a Deployment, a ClusterIP Service, gRPC probes on its
health port, a NetworkPolicy and a termination grace period matching its drain setting; every
pod runs locked down and sized; credentials arrive only through secretKeyRef and the worker
never sees the database; ingress follows who calls whom. Overlay-specific rules (mTLS in prod,
the in-cluster backing services in dev) and strict schema validation are in
test_k8s_overlays.py.
"""

from __future__ import annotations

import importlib
import re

import pytest

from tests.unit.k8s_support import (
    GRACE_HEADROOM_S,
    HEALTH_PORT,
    HTTP_PORT,
    IMAGE,
    NAMESPACE,
    OVERLAYS,
    PORT,
    SERVICES,
    Rendered,
    component,
    containers,
    pod_labels,
    secret_refs,
    selects,
)
from tether.runtime.rpc import LIVENESS
from tether.settings import PlatformSettings

# Overlays that scale: autoscalers and disruption budgets as the base has them. The others run
# one replica of each service with neither.
SCALED = {"prod"}
AUTOSCALED = {"gateway": None, "worker": (2, 20)}
# Who dials whom; every other ingress is refused. Backing services exist in some overlays only.
CALLERS: dict[str, set[str]] = {
    "gateway": {"*"},
    "admission": {"gateway"},
    "orchestrator": {"gateway", "worker", "interactions"},
    "interactions": {"gateway", "worker", "orchestrator"},
    "worker": set(),
    "postgres": {"gateway", "admission", "orchestrator", "interactions", "migrate"},
    "redis": {"gateway", "admission", "orchestrator", "worker"},
    "model": {"worker"},
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
    "POSTGRES_PASSWORD": "tether-dev-postgres",
    "REDIS_PASSWORD": "tether-dev-redis",
    "WORKER_REDIS_PASSWORD": "tether-dev-redis",
    "TETHER_SECRETS_KEY": "tether-secrets-key",
}
# The worker's own: a Redis user that may only publish live deltas.
WORKER_SECRET_ENV = {"TETHER_REDIS_URL": "tether-worker-redis"}
# Each calling service's own credential, from a Secret no other service reads.
CREDENTIAL_ENV = "TETHER_SERVICE_CREDENTIAL"
CREDENTIAL_HOLDERS = ("gateway", "worker", "interactions", "orchestrator")
VERIFIER_HOLDERS = ("admission", "orchestrator", "interactions")
MIGRATE = (
    "import asyncio,os; from tether.db.migrate import upgrade; "
    "asyncio.run(upgrade(os.environ['TETHER_DATABASE_URL']))"
)


def credential_secret(service: str) -> str:
    return f"tether-{service}-credential"


def settings_prefix(service: str) -> str:
    """The env prefix of a service's settings class (TETHER_ADMISSION_, ...)."""
    module = importlib.import_module(f"services.{service}.settings")
    (settings,) = [
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, PlatformSettings)
        and value.__module__ == module.__name__  # not the bases it imports
    ]
    assert "grace_s" in settings.model_fields, f"{service} has no drain setting"
    assert "health_port" in settings.model_fields
    return str(settings.model_config["env_prefix"])


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> Rendered:
    return Rendered.of(f"overlays/{request.param}")


def overlay(rendered: Rendered) -> str:
    return rendered.name.removeprefix("overlays/")


# -- objects ---------------------------------------------------------------------------------


def test_there_are_overlays_to_check() -> None:
    assert set(OVERLAYS) >= {"dev", "prod"}
    assert set(SERVICES) >= {"gateway", "admission", "orchestrator", "interactions", "worker"}


def test_no_secret_object_is_applied(rendered: Rendered) -> None:
    assert not rendered.objects("Secret"), "Secrets are made out of band, never committed"


def test_everything_lives_in_the_namespace(rendered: Rendered) -> None:
    assert NAMESPACE in rendered.objects("Namespace")
    for doc in rendered.docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, doc["metadata"]["name"]


# -- per service -----------------------------------------------------------------------------


@pytest.mark.parametrize("service", SERVICES)
def test_service_runs_its_own_module_from_the_one_image(rendered: Rendered, service: str) -> None:
    container = rendered.container(service)
    assert container["image"].startswith(IMAGE + ":")
    assert container["command"] == ["python", "-m", f"services.{service}"]
    ports = {(p["name"], p["containerPort"]) for p in container["ports"]}
    assert {("grpc", PORT), ("health", HEALTH_PORT)} <= ports


@pytest.mark.parametrize("service", SERVICES)
def test_service_has_a_clusterip_service_on_grpc_port(rendered: Rendered, service: str) -> None:
    services = rendered.objects("Service")
    assert service in services, f"no Service for {service}"
    spec = services[service]["spec"]
    assert spec.get("type", "ClusterIP") == "ClusterIP"
    expected = [("grpc", PORT), *([("http", HTTP_PORT)] if service == "gateway" else [])]
    assert [(p["name"], p["port"]) for p in spec["ports"]] == expected
    assert selects(spec["selector"], pod_labels(rendered.deployment(service)))


@pytest.mark.parametrize("service", SERVICES)
def test_service_is_probed_over_grpc_health_on_its_health_port(
    rendered: Rendered, service: str
) -> None:
    container = rendered.container(service)
    for probe in ("startupProbe", "livenessProbe"):
        # Alive as soon as it serves: a pod waiting for the migrations is not restarted.
        assert container[probe]["grpc"] == {"port": HEALTH_PORT, "service": LIVENESS}, probe
    # Ready only when the server as a whole is: the schema at this release's migrations.
    assert container["readinessProbe"]["grpc"] == {"port": HEALTH_PORT}
    config = rendered.config()
    assert config[f"{settings_prefix(service)}HEALTH_PORT"] == str(HEALTH_PORT)


@pytest.mark.parametrize("service", SERVICES)
def test_termination_grace_matches_the_drain_setting(rendered: Rendered, service: str) -> None:
    pod = rendered.deployment(service)["spec"]["template"]["spec"]
    drain = float(rendered.config()[f"{settings_prefix(service)}GRACE_S"])
    assert pod["terminationGracePeriodSeconds"] == drain + GRACE_HEADROOM_S


def test_worker_gets_the_longest_grace(rendered: Rendered) -> None:
    graces = {
        s: rendered.deployment(s)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        for s in SERVICES
    }
    assert graces["worker"] >= 60
    assert all(graces["worker"] > grace for s, grace in graces.items() if s != "worker")


@pytest.mark.parametrize("service", SERVICES)
def test_service_binds_and_finds_peers_through_the_configmap(
    rendered: Rendered, service: str
) -> None:
    config = rendered.config()
    container = rendered.container(service)
    assert {"configMapRef": {"name": "tether-config"}} in container["envFrom"]
    prefix = settings_prefix(service)
    assert config[f"{prefix}HOST"] == "0.0.0.0"
    assert config[f"{prefix}PORT"] == str(PORT)
    for peer in ("admission", "orchestrator", "interactions"):
        address = f"{peer}.{NAMESPACE}.svc.cluster.local:{PORT}"
        assert config[f"TETHER_{peer.upper()}_ADDR"] == address
        assert peer in rendered.objects("Service")


@pytest.mark.parametrize("service", SERVICES)
def test_replicas_budgets_and_autoscalers(rendered: Rendered, service: str) -> None:
    spec = rendered.deployment(service)["spec"]
    labels = pod_labels(rendered.deployment(service))
    pdbs = [
        pdb
        for pdb in rendered.objects("PodDisruptionBudget").values()
        if selects(pdb["spec"]["selector"]["matchLabels"], labels)
    ]
    hpas = {
        hpa["spec"]["scaleTargetRef"]["name"]: hpa
        for hpa in rendered.objects("HorizontalPodAutoscaler").values()
    }
    if overlay(rendered) not in SCALED:
        assert spec["replicas"] == 1 and not pdbs and service not in hpas
        return
    assert len(pdbs) == 1, f"{service}: expected one PodDisruptionBudget"
    budget = pdbs[0]["spec"]
    if service == "worker":
        assert budget.get("maxUnavailable") == 1 and "minAvailable" not in budget
    else:
        assert budget.get("minAvailable") == 1 and "maxUnavailable" not in budget
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
        assert spec["replicas"] >= 2, "room for the budget during a drain"


# -- security --------------------------------------------------------------------------------


def test_every_pod_is_locked_down_and_sized(rendered: Rendered) -> None:
    for workload in rendered.workloads():
        name = workload["metadata"]["name"]
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod.get("automountServiceAccountToken") is False, name
        for container in containers(workload):
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["capabilities"]["drop"] == ["ALL"], name
            assert not context["capabilities"].get("add"), name
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][bound]), name


def test_credentials_arrive_only_through_secret_key_refs(rendered: Rendered) -> None:
    assert not set(rendered.config()) & set(SECRET_ENV), "credentials in the ConfigMap"
    for workload in rendered.workloads():
        name = workload["metadata"]["name"]
        for container in containers(workload):
            for source in container.get("envFrom", []):
                assert "secretRef" not in source, f"{name}: whole-Secret envFrom hides what it gets"
            for entry in container.get("env", []):
                if entry["name"] == CREDENTIAL_ENV:
                    ref = entry["valueFrom"]["secretKeyRef"]
                    assert ref["name"] == credential_secret(name), f"{name}: another's credential"
                    assert ref["key"] == CREDENTIAL_ENV, name
                elif entry["name"] in SECRET_ENV:
                    assert "value" not in entry, f"{name}: literal {entry['name']}"
                    ref = entry["valueFrom"]["secretKeyRef"]
                    own = WORKER_SECRET_ENV if name == "worker" else {}
                    assert ref["name"] == own.get(entry["name"], SECRET_ENV[entry["name"]]), name
                    assert ref["key"] == entry["name"], name


def test_the_worker_holds_no_database_credentials_and_its_own_redis_user(
    rendered: Rendered,
) -> None:
    worker = rendered.deployment("worker")
    refs = secret_refs(worker)
    assert "TETHER_DATABASE_URL" not in refs
    assert not {ref["name"] for ref in refs.values()} & {"tether-database", "tether-redis"}
    assert refs["TETHER_REDIS_URL"]["name"] == "tether-worker-redis"
    assert not refs["TETHER_REDIS_URL"].get("optional", False), "its runs stream live deltas"
    for container in containers(worker):
        names = {entry["name"] for entry in container.get("env", [])}
        assert "TETHER_DATABASE_URL" not in names


def test_database_and_model_credentials_go_where_they_are_needed(rendered: Rendered) -> None:
    for service in SERVICES:
        refs = secret_refs(rendered.deployment(service))
        has_db = refs.get("TETHER_DATABASE_URL", {}).get("name") == "tether-database"
        assert has_db == (service in DATABASE_USERS), service
        uses_anthropic = any(ref["name"] == "tether-anthropic" for ref in refs.values())
        assert uses_anthropic == (service == "worker"), service
    api_key = secret_refs(rendered.deployment("worker"))["TETHER_WORKER_ANTHROPIC_API_KEY"]
    assert not api_key.get("optional", False)


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_carries_only_its_own_credential_and_its_callers_verifiers(
    rendered: Rendered, service: str
) -> None:
    refs = secret_refs(rendered.deployment(service))
    credential = refs.get(CREDENTIAL_ENV)
    assert (credential is not None) == (service in CREDENTIAL_HOLDERS), service
    if credential is not None:
        assert credential["name"] == credential_secret(service)
        assert not credential.get("optional", False), "a caller must not start without it"
    names = {ref["name"] for ref in refs.values()}
    others = {credential_secret(s) for s in CREDENTIAL_HOLDERS if s != service}
    assert not names & others, f"{service} can read another service's credential"
    verifiers = refs.get("TETHER_SERVICE_VERIFIERS")
    assert (verifiers is not None) == (service in VERIFIER_HOLDERS), service
    if verifiers is not None:
        assert not verifiers.get("optional", False), "a server must not start without them"
    operator = refs.get("TETHER_GATEWAY_OPERATOR_CREDENTIAL_SHA256")
    assert (operator is not None) == (service == "gateway"), service


def test_migrations_job(rendered: Rendered) -> None:
    (job,) = rendered.objects("Job").values()
    assert job["apiVersion"] == "batch/v1"
    spec = job["spec"]
    assert spec["backoffLimit"] >= 1
    assert spec["ttlSecondsAfterFinished"] > 0
    assert spec["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")
    (container,) = spec["template"]["spec"]["containers"]
    assert container["image"].startswith(IMAGE + ":")
    assert container["command"] == ["python", "-c", MIGRATE]
    assert secret_refs(job)["TETHER_DATABASE_URL"]["name"] == "tether-database"


def test_images_are_pinned_and_tethers_share_one_tag(rendered: Rendered) -> None:
    images = {c["image"] for w in rendered.workloads() for c in containers(w)}
    ours = {image for image in images if image.startswith(IMAGE + ":")}
    assert len(ours) == 1, f"one release of Tether at a time: {ours}"
    for image in images:
        # A release (16.9, 7.4.4, 0.1.0), never a moving name (latest, 16, bookworm).
        assert re.fullmatch(r"[^:]+:\d+\.\d+[\w.-]*", image), f"{image}: pin a release"


# -- network policy --------------------------------------------------------------------------


def ingress_callers(rendered: Rendered, target: str) -> set[str]:
    """Components allowed to reach `target`'s pods; "*" stands for anything wider. Every rule
    opens exactly the ports the target's Service exposes."""
    labels = {"app.kubernetes.io/name": "tether", "app.kubernetes.io/component": target}
    allowed = sorted(p["port"] for p in rendered.objects("Service")[target]["spec"]["ports"])
    callers: set[str] = set()
    for policy in rendered.objects("NetworkPolicy").values():
        spec = policy["spec"]
        if "Ingress" not in spec["policyTypes"]:
            continue
        if not selects(spec["podSelector"].get("matchLabels", {}), labels):
            continue
        for rule in spec.get("ingress", []):
            ports = sorted(p["port"] for p in rule.get("ports", []))
            assert ports == allowed, f"{policy['metadata']['name']}: only the Service's ports"
            assert all(p.get("protocol", "TCP") == "TCP" for p in rule["ports"])
            if "from" not in rule:
                callers.add("*")
            for peer in rule.get("from", []):
                selector = peer.get("podSelector", {}).get("matchLabels", {})
                name = selector.get("app.kubernetes.io/component")
                callers.add(name if set(peer) == {"podSelector"} and name else "*")
    return callers


def test_ingress_is_denied_by_default(rendered: Rendered) -> None:
    denials = [
        p
        for p in rendered.objects("NetworkPolicy").values()
        if p["spec"]["podSelector"] in ({}, {"matchLabels": {}})
        and "Ingress" in p["spec"]["policyTypes"]
        and not p["spec"].get("ingress")
    ]
    assert denials, "no default-deny ingress policy"


def test_every_component_admits_only_its_callers(rendered: Rendered) -> None:
    components = {component(w) for w in rendered.workloads()} - {"migrate"}
    assert set(SERVICES) <= components
    for target in sorted(components):
        assert target in CALLERS, f"{target}: who may call it?"
        assert ingress_callers(rendered, target) == CALLERS[target], target


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_has_its_own_policy(rendered: Rendered, service: str) -> None:
    labels = pod_labels(rendered.deployment(service))
    own = [
        p
        for p in rendered.objects("NetworkPolicy").values()
        if p["spec"]["podSelector"].get("matchLabels")
        and selects(p["spec"]["podSelector"]["matchLabels"], labels)
    ]
    assert own, f"no NetworkPolicy of its own for {service}"


def test_only_interactions_holds_the_secrets_key(rendered: Rendered) -> None:
    for service in SERVICES:
        ref = secret_refs(rendered.deployment(service)).get("TETHER_SECRETS_KEY")
        assert (ref is not None) == (service == "interactions"), service
