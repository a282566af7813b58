#!/usr/bin/env bash
# Creates the Secrets the dev overlay reads, with fresh random values that never touch git. Run
# it once before `kubectl apply -k deploy/k8s/overlays/dev`; run again, it keeps what exists.
# With ANTHROPIC_API_KEY set the worker calls Anthropic; without it, the in-cluster demo model.
# Needs kubectl (pointed at your dev cluster), openssl and sha256sum.
set -euo pipefail

NS="${NS:-tether}"
KUBECTL="${KUBECTL:-kubectl}"

rand() { openssl rand -hex 32; }
sha256() { printf %s "$1" | sha256sum | cut -d' ' -f1; }
exists() { "$KUBECTL" -n "$NS" get secret "$1" >/dev/null 2>&1; }
create() {
  local name="$1"
  shift
  "$KUBECTL" -n "$NS" create secret generic "$name" "$@" >/dev/null
  echo "created secret $name" >&2
}

"$KUBECTL" get namespace "$NS" >/dev/null 2>&1 || "$KUBECTL" create namespace "$NS" >/dev/null

# PostgreSQL's password is fixed when its volume is first initialised: keep the pair together
# (delete the StatefulSet's volume too before making a new one).
if ! exists tether-dev-postgres; then
  password="$(rand)"
  create tether-dev-postgres --from-literal=POSTGRES_PASSWORD="$password"
  "$KUBECTL" -n "$NS" delete secret tether-database --ignore-not-found >/dev/null
  create tether-database \
    --from-literal=TETHER_DATABASE_URL="postgresql://tether:${password}@postgres.${NS}.svc.cluster.local:5432/tether"
fi

# The services' Redis user (default) and the workers' (tether-worker: PUBLISH on live deltas).
if ! exists tether-dev-redis; then
  password="$(rand)"
  worker_password="$(rand)"
  create tether-dev-redis --from-literal=REDIS_PASSWORD="$password" \
    --from-literal=WORKER_REDIS_PASSWORD="$worker_password"
  "$KUBECTL" -n "$NS" delete secret tether-redis tether-worker-redis --ignore-not-found >/dev/null
  create tether-redis \
    --from-literal=TETHER_REDIS_URL="redis://:${password}@redis.${NS}.svc.cluster.local:6379/0"
  create tether-worker-redis \
    --from-literal=TETHER_REDIS_URL="redis://tether-worker:${worker_password}@redis.${NS}.svc.cluster.local:6379/0"
fi

# Each calling service's own credential; the servers get only their SHA-256 (the verifiers).
if ! exists tether-service-verifiers; then
  verifiers=""
  for svc in gateway worker interactions orchestrator; do
    secret="$(rand)"
    "$KUBECTL" -n "$NS" delete secret "tether-$svc-credential" --ignore-not-found >/dev/null
    create "tether-$svc-credential" --from-literal=TETHER_SERVICE_CREDENTIAL="$secret"
    verifiers="${verifiers:+$verifiers,}$svc=$(sha256 "$secret")"
  done
  create tether-service-verifiers --from-literal=TETHER_SERVICE_VERIFIERS="$verifiers"
fi

# The secret store's key (interactions only): one AES-256 key, id dev1. Kept once made: what
# it sealed opens only under it.
if ! exists tether-secrets-key; then
  create tether-secrets-key \
    --from-literal=TETHER_SECRETS_KEY="dev1:$(openssl rand -base64 32)"
fi

# The platform operator (creates tenants and keys); shown once, the cluster keeps its hash.
if ! exists tether-operator; then
  operator="top_$(rand)"
  create tether-operator \
    --from-literal=TETHER_GATEWAY_OPERATOR_CREDENTIAL_SHA256="$(sha256 "$operator")"
  echo "platform operator credential (keep it; it is not stored anywhere): $operator"
fi

if ! exists tether-anthropic; then
  if [ -n "${ANTHROPIC_API_KEY:-}" ]; then
    create tether-anthropic --from-literal=TETHER_WORKER_ANTHROPIC_API_KEY="$ANTHROPIC_API_KEY"
  else
    create tether-anthropic \
      --from-literal=TETHER_WORKER_ANTHROPIC_API_KEY=local-model-server \
      --from-literal=TETHER_WORKER_ANTHROPIC_BASE_URL="http://model.${NS}.svc.cluster.local:8000"
  fi
fi
