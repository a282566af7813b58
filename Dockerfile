# syntax=docker/dockerfile:1
# Tether's one image: every service, started as `python -m services NAME` (the k8s manifests
# run `python -m services.NAME`), the default chosen at build time with --build-arg SERVICE=.
#
#   docker build -t tether .                      # default service: gateway
#   docker run --env-file tether.env tether worker
#
# tests/system/test_image.py replays this file's steps outside a container (the same lock, the
# same commands, the same entry point) to catch a broken step where no engine runs: keep every
# RUN to pip, python, npm and node working in $VIRTUAL_ENV and the working directory.

# Both stages on one exact Python release (its slim Debian image); pin the digest as well
# where a registry can be reached: python:3.11.13-slim-bookworm@sha256:...
FROM python:3.11.13-slim-bookworm AS build
ENV VIRTUAL_ENV=/opt/tether \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INPUT=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv "$VIRTUAL_ENV"
# Dependencies first, in their own layer: they change far less often than the code.
COPY requirements.lock requirements-runtime.in ./
RUN --mount=type=cache,target=/root/.cache/pip \
    "$VIRTUAL_ENV/bin/pip" install -c requirements.lock -r requirements-runtime.in
COPY pyproject.toml ./
COPY libs ./libs
COPY services ./services
# The package itself (tether and services, migrations included), never its dependencies
# again: everything it runs on came from the lock above, and pip check proves it is whole.
RUN --mount=type=cache,target=/root/.cache/pip \
    "$VIRTUAL_ENV/bin/pip" install --no-deps . \
    && "$VIRTUAL_ENV/bin/pip" check

# The web console (web/console/dist), built from the npm lock; the gateway serves it at /console.
FROM node:20.20.2-bookworm-slim AS console
WORKDIR /web
COPY package.json package-lock.json ./
COPY web/client/package.json web/client/
COPY web/react/package.json web/react/
COPY web/console/package.json web/console/
RUN --mount=type=cache,target=/root/.npm \
    npm ci --no-audit --no-fund --ignore-scripts
COPY web/client/src web/client/src
COPY web/react/src web/react/src
COPY web/console web/console
RUN node_modules/.bin/vite build web/console --logLevel warn

FROM python:3.11.13-slim-bookworm AS runtime
ARG SERVICE=gateway
ENV VIRTUAL_ENV=/opt/tether
# PYTHONSAFEPATH: nothing is imported from the working directory (the only writable one
# under the manifests' read-only root is /tmp), only from the installed package.
ENV PATH="$VIRTUAL_ENV/bin:$PATH" \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONSAFEPATH=1 \
    PYTHONUNBUFFERED=1 \
    TETHER_GATEWAY_CONSOLE_DIR=/opt/tether-console \
    TETHER_SERVICE=$SERVICE
# Only the virtual environment: no compiler, no pip cache, no sources beside the package.
COPY --from=build $VIRTUAL_ENV $VIRTUAL_ENV
COPY --from=console /web/web/console/dist $TETHER_GATEWAY_CONSOLE_DIR
# Not root: the uid the manifests' securityContext runs as (no login, no home needed).
USER 10001:10001
# gRPC, the plaintext health-only port (probes), the gateway's HTTP/SSE bridge.
EXPOSE 7000 7001 8080
ENTRYPOINT ["python", "-m", "services"]
