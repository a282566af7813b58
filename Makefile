# Tether: `make run` starts the whole stack; `make test` runs the suite. Both bootstrap .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.bench-installed
BENCH ?=
# Protos are checked for breaking changes against main as it was when the execution-core change
# began (not only the previous commit); intentional breaks are declared in buf.yaml's ignore list.
PROTO_BASE ?= 71abcdb46e9f71345835d02f1a91816ed7f7dce3
MINUTES ?= 5
SEED ?=
# The suites start hundreds of service and CLI processes. Where the environment says not to write
# bytecode (PYTHONDONTWRITEBYTECODE), each would compile the sources it imports again: they are
# compiled once, before a suite runs, and every process reads them.
COMPILE := $(BIN)/python -m compileall -q services libs bench tests examples/tools

.PHONY: run test slow fuzz lint gen docs bench drill venv clean console browser node packages

# The browser side (web/): one npm workspace, installed from package-lock.json.
NODE_STAMP := node_modules/.installed
CONSOLE_DIST := web/console/dist/index.html
CONSOLE_SOURCES := $(shell find web/client/src web/react/src web/console/src -type f 2>/dev/null) \
	web/console/index.html web/console/vite.config.ts web/console/package.json

venv: $(STAMP)

# The example tool package (examples/tools) is installed the way a team installs its own tools
# beside the worker: its `tether.tools` entry point makes every worker offer them.
$(STAMP): requirements.lock pyproject.toml examples/tools/pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11+ is required")'
	@echo "installing into $(VENV) from requirements.lock" >&2
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install --quiet --upgrade pip >&2
	@$(BIN)/python -m pip install --quiet -r requirements.lock >&2
	@$(BIN)/python -m pip install --quiet --no-deps -e . >&2
	@$(BIN)/python -m pip install --quiet --no-deps -e examples/tools >&2
	@touch $(STAMP)

run: venv $(CONSOLE_DIST)
	$(BIN)/tether up

# Vitest (the TypeScript client, hooks and generated types) first, then the Python suite (its
# testpaths include examples/tools/tests, the example tool package's own tests), printing its 30
# slowest tests so the 15-minute budget stays in view.
test: venv $(NODE_STAMP)
	node_modules/.bin/vitest run --silent
	@$(COMPILE) >/dev/null
	$(BIN)/python -m pytest -q --durations=30

# The slow checks, tens of seconds to minutes each, kept out of `make test` (.ci/run runs this
# after it): the chaos soak's 60 seconds with a fixed seed, the image's install replayed from the
# lock, `tether up` and its supervision, a rolling restart, the long growth checks, and the system
# modules that start whole stacks or kill and restart processes (interactions, drills, streaming,
# outages, timers, schedules, channels and webhooks end to end, workers killed mid-stream, the
# release before running beside this one, ...).
slow: venv
	@$(COMPILE) >/dev/null
	$(BIN)/python -m pytest -q -m slow

# The hostile-input suites at full size: 2,000 generated requests per surface.
fuzz: venv
	@$(COMPILE) >/dev/null
	TETHER_FUZZ_REQUESTS=2000 $(BIN)/python -m pytest -q tests/system/test_fuzz_grpc.py tests/system/test_fuzz_http.py

lint: venv $(NODE_STAMP)
	$(BIN)/ruff check services libs tests bench
	$(BIN)/ruff format --check services libs tests bench
	MYPYPATH=libs $(BIN)/mypy --strict services libs
	$(BIN)/hadolint Dockerfile
	node_modules/.bin/buf lint
	node_modules/.bin/buf breaking --against '.git#ref=$(PROTO_BASE)'
	node_modules/.bin/tsc --noEmit -p tsconfig.json

node: $(NODE_STAMP)

$(NODE_STAMP): package.json package-lock.json web/client/package.json web/react/package.json web/console/package.json
	npm ci --silent --no-fund --no-audit
	@touch $@

# The web console, served by the gateway at /console from web/console/dist.
console: $(NODE_STAMP)
	node_modules/.bin/vite build web/console --logLevel warn

$(CONSOLE_DIST): $(NODE_STAMP) $(CONSOLE_SOURCES)
	node_modules/.bin/vite build web/console --logLevel warn
	@touch $@

# Browser tests: the console in Debian's headless chromium against the stack as real processes.
browser: venv $(CONSOLE_DIST)
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
	node_modules/.bin/vite build web/examples/embed --logLevel warn
	@$(COMPILE) >/dev/null
	$(BIN)/python -m pytest -q -m browser tests/browser

# @tether/client and @tether/react built and packed for npm: build/web/packages/*.tgz.
packages: $(NODE_STAMP)
	node scripts/pack_web.mjs

gen: venv $(NODE_STAMP)
	PATH=$(BIN):$$PATH ./scripts/gen_protos.sh

# README.md's configuration reference, from the settings classes (a test fails while it is stale).
docs: venv
	$(BIN)/python -m tether.stack.reference

# Figures only on stdout: one JSON object per line. The peers the bench runs beside Tether
# (pgqueuer, procrastinate) come from their own lock, installed here and nowhere else.
bench: venv $(BENCH_STAMP)
	@$(BIN)/python -m bench $(BENCH)

$(BENCH_STAMP): $(STAMP) requirements-bench.lock
	@echo "installing the bench's peers into $(VENV) from requirements-bench.lock" >&2
	@$(BIN)/python -m pip install --quiet -r requirements-bench.lock -c requirements.lock >&2
	@touch $(BENCH_STAMP)

# The chaos soak on its own durable PostgreSQL: progress on stderr, one JSON report last on
# stdout, non-zero exit when an invariant fails. SEED= replays a run's fault schedule.
drill: venv
	@$(BIN)/python -m tests.drill --minutes $(MINUTES) $(if $(SEED),--seed $(SEED))

clean:
	rm -rf $(VENV) .tether node_modules web/console/dist web/examples/embed/dist
