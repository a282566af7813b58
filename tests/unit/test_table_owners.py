"""Each table has one owning service, and only its owner's modules name it (README, "Who owns
which table"). The run aggregate is written through the orchestrator's repositories alone; the
one sanctioned exception is admission creating a queued run through `intake`, in its own
transaction, because the claim and the run it creates must commit together."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

OWNER = {
    # The run aggregate.
    "runs": "orchestrator",
    "run_events": "orchestrator",
    "run_event_log": "orchestrator",
    "run_keys": "orchestrator",
    "run_parts": "orchestrator",
    "attempts": "orchestrator",
    "effects": "orchestrator",
    "deliveries": "orchestrator",
    "channel_statuses": "orchestrator",
    "usage_turns": "orchestrator",
    "tool_outputs": "orchestrator",
    "routings": "orchestrator",
    "model_limit_levels": "orchestrator",
    "model_limit_replicas": "orchestrator",
    "context_summaries": "orchestrator",
    # A tenant's knowledge, served by the orchestrator to its runs' workers.
    "documents": "orchestrator",
    "agents": "orchestrator",
    "agent_versions": "orchestrator",
    "agent_sets": "orchestrator",
    "tool_catalog": "orchestrator",
    # Run-event webhooks: the orchestrator owns the events they carry.
    "webhook_subscriptions": "orchestrator",
    "webhook_deliveries": "orchestrator",
    "tenant_queues": "orchestrator",
    "tenant_stripes": "orchestrator",
    # Inbound events and conversations.
    "event_claims": "admission",
    "messages": "admission",
    "sessions": "admission",
    "schedules": "admission",
    # People in the loop.
    "interactions": "interactions",
    "grants": "interactions",
    "connections": "interactions",
    "secrets": "interactions",
    "channel_connections": "interactions",
    "webhook_secrets": "interactions",
    # Callers and their tenants (through libs/tether/apikeys.py, which the gateway serves).
    "api_keys": "gateway",
    "tenants": "gateway",
    # Browser sessions and tokens minted from those keys.
    "browser_credentials": "gateway",
    # An append-only journal: every service appends its own records through tether.audit.
    "audit_log": "audit",
}

# Where a module that is not the owner names a table, and why.
EXCEPTIONS = {
    # A session's head (sessions.active_run_id) is the run queue's: the aggregate's module
    # sets it when a run is admitted and hands it on when a run ends.
    ("services/orchestrator/repositories/intake.py", "sessions"),
    ("services/orchestrator/repositories/transitions.py", "sessions"),
    # Retention keeps a conversation's history while it has a run to go: its session's head.
    ("services/orchestrator/repositories/retention.py", "sessions"),
    # Reads of a tenant's configuration: its agent (routing) and its approval policy.
    ("services/orchestrator/repositories/leases.py", "tenants"),
    # Reads of the operator's settings of a tenant: its weight (admission's start tag) and its
    # cap on runs running at once (the claim).
    ("services/orchestrator/repositories/fair_tags.py", "tenants"),
    # A child run (a `delegate` call's) is made with its own session and the message that is its
    # input, in one transaction with its parent's child.started: the intake's crossing, the
    # other way (run trees, issue 33).
    ("services/orchestrator/repositories/intake.py", "messages"),
    ("services/orchestrator/repositories/fair.py", "tenants"),
    # Where a leased run came from (its message's source and actor): routing picks persona and
    # skills by its source, and the live facts name its actor.
    ("services/orchestrator/repositories/leases.py", "messages"),
    # The claim passes over a queued run whose agent is at its cap: its route is read by its
    # message's source and channel connection (agent caps).
    ("services/orchestrator/repositories/agent_caps.py", "messages"),
    ("services/interactions/repository.py", "tenants"),
    # Each owner's retention sweep reads every tenant's retention policy.
    ("libs/tether/retention.py", "tenants"),
    # The viewer's filter, applied where runs are read (the orchestrator's repositories).
    ("libs/tether/visibility.py", "runs"),
}

LIBS_OWNER = {"libs/tether/apikeys.py": "gateway", "libs/tether/audit.py": "audit"}


def owner_of(path: Path) -> str | None:
    relative = path.relative_to(ROOT).as_posix()
    if relative.startswith("services/"):
        return relative.split("/")[1]
    return LIBS_OWNER.get(relative)


def tables_named(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module == "tether.db.schema":
            names.update(alias.name for alias in node.names if alias.name in OWNER)
    return names


def modules() -> list[Path]:
    found = [
        *sorted((ROOT / "services").rglob("*.py")),
        *sorted((ROOT / "libs/tether").rglob("*.py")),
    ]
    return [p for p in found if "/v1/" not in p.as_posix() and "/migrations/" not in p.as_posix()]


@pytest.mark.parametrize("path", modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_module_names_only_tables_its_service_owns(path: Path) -> None:
    relative = path.relative_to(ROOT).as_posix()
    owner = owner_of(path)
    wrong = sorted(
        table
        for table in tables_named(path)
        if OWNER[table] != owner and (relative, table) not in EXCEPTIONS
    )
    assert not wrong, f"{relative} names {wrong}, owned by {[OWNER[t] for t in wrong]}"


# Views: read like tables, and owned like them, but made by a migration and not in `metadata`.
VIEWS = {"run_event_log"}


def test_every_table_of_the_schema_has_an_owner() -> None:
    from tether.db.schema import metadata

    assert set(metadata.tables) == set(OWNER) - VIEWS


def test_every_exception_is_still_needed() -> None:
    for relative, table in EXCEPTIONS:
        assert table in tables_named(ROOT / relative), f"{relative} no longer names {table}"


def service_imports(path: Path) -> set[str]:
    """Every name imported from a service package, as `module.name`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("services."):
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("services."))
    return names


@pytest.mark.parametrize(
    "path", sorted((ROOT / "services").rglob("*.py")), ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_a_service_imports_no_other_service_but_admission_the_intake(path: Path) -> None:
    service = path.relative_to(ROOT).parts[1]
    foreign = {m for m in service_imports(path) if m.split(".")[1] != service}
    if service == "admission":
        foreign -= {"services.orchestrator.repositories.intake"}
    assert not foreign, f"{path.relative_to(ROOT)} imports {sorted(foreign)}"


def test_the_import_check_sees_another_service(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from services.orchestrator.repositories import intake, transitions\n")
    assert service_imports(probe) == {
        "services.orchestrator.repositories.intake",
        "services.orchestrator.repositories.transitions",
    }
