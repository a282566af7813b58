"""The whole schema as SQLAlchemy Core tables, each beside its indexes, a module per owning
service (README, "Who owns which table"):

- `gateway_tables`: tenants, api_keys, browser_credentials;
- `admission_tables`: sessions, messages, event_claims, schedules (admission creates the queued
  run, through the orchestrator's intake);
- `orchestrator_tables`: the run aggregate (runs, run_events, run_parts, attempts, effects,
  usage_turns, tool_outputs, routings, context_summaries, deliveries; `run_event_log`, the view
  every reader of a run's events reads), documents and agents (agents, agent_versions,
  agent_sets), the tool catalog (tool_catalog), what channel providers report of sent messages
  (channel_statuses) and run-event webhooks;
- `run_indexes`: the indexes of `runs`, and `run_keys` (a run's lookup keys, off its row) with
  its own;
- `interactions_tables`: interactions, grants, connections, secrets,
  channel_connections;
- `audit_tables`: audit_log, appended to by every service.

Import tables from here (`from tether.db.schema import runs`): `metadata` holds them all. A search
by state goes through `in_state`, so that the state's partial index serves it.
"""

from __future__ import annotations

from tether.db.schema import run_indexes  # noqa: F401  (the indexes of runs, on `metadata`)
from tether.db.schema.admission_tables import event_claims, messages, schedules, sessions
from tether.db.schema.audit_tables import audit_log
from tether.db.schema.base import in_state, metadata
from tether.db.schema.gateway_tables import api_keys, browser_credentials, tenants
from tether.db.schema.interactions_tables import (
    channel_connections,
    connections,
    grants,
    interactions,
    secrets,
    webhook_secrets,
)
from tether.db.schema.orchestrator_tables import (
    agent_sets,
    agent_versions,
    agents,
    attempts,
    channel_statuses,
    context_summaries,
    deliveries,
    documents,
    effects,
    routings,
    run_event_log,
    run_events,
    run_parts,
    runs,
    tenant_queues,
    tenant_stripes,
    tool_catalog,
    tool_outputs,
    usage_turns,
)
from tether.db.schema.run_indexes import keyed_runs, run_keys
from tether.db.schema.webhook_tables import webhook_deliveries, webhook_subscriptions

__all__ = [
    "agent_sets",
    "agent_versions",
    "agents",
    "api_keys",
    "attempts",
    "audit_log",
    "browser_credentials",
    "channel_connections",
    "channel_statuses",
    "connections",
    "context_summaries",
    "deliveries",
    "documents",
    "effects",
    "event_claims",
    "grants",
    "in_state",
    "interactions",
    "keyed_runs",
    "messages",
    "metadata",
    "routings",
    "run_event_log",
    "run_events",
    "run_keys",
    "run_parts",
    "runs",
    "schedules",
    "secrets",
    "sessions",
    "tenant_queues",
    "tenant_stripes",
    "tenants",
    "tool_catalog",
    "tool_outputs",
    "usage_turns",
    "webhook_deliveries",
    "webhook_secrets",
    "webhook_subscriptions",
]
