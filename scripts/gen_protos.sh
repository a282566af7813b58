#!/usr/bin/env bash
# Generates the Python, gRPC and .pyi code for protos/tether/v1 into libs/tether/v1, and the
# TypeScript types of web/client into web/client/src/gen.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
rm -rf libs/tether/v1
mkdir -p libs/tether/v1
"$py" -m grpc_tools.protoc -I protos \
  --python_out=libs --grpc_python_out=libs \
  --mypy_out=libs --mypy_grpc_out=libs \
  protos/tether/v1/*.proto
touch libs/tether/v1/__init__.py libs/tether/v1/py.typed

# The TypeScript types of web/client (protobuf-es, JSON shapes included), through the repo's buf.
rm -rf web/client/src/gen
node_modules/.bin/buf generate --template buf.gen.ts.yaml
