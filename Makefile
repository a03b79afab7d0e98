# The two set-up commands are `make run` and `make test`; the rest are helpers.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadfile
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: run test lint check pytest bench soak clean lock

$(VENV)/.base-installed: requirements/base.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements/base.txt
	touch $@

$(VENV)/.dev-installed: requirements/dev.txt requirements/otel.txt requirements/base.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements/dev.txt
	touch $(VENV)/.base-installed $@

## make run: a working service on the embedded SQLite database, with a demo tenant,
## endpoint and receiver, web + scheduler + relay + workers in the foreground.
run: $(VENV)/.base-installed
	$(PY) scripts/run_demo.py

## make test: Debian's chromium and pgbouncer installed when missing (the browser and
## PgBouncer tests start their own), then lint, Django checks, migrations check, the
## migration linter (no backward-incompatible migration), the whole suite on
## PostgreSQL, then the pipeline's tests (those marked sqlite, docs/testing.md) again on
## a SQLite file in a temporary directory. Each run spreads its test files over two pytest-xdist workers (PYTEST_WORKERS).
## PYTEST_ARGS applies to both runs (the SQLite one passes if it selects none).
test: $(VENV)/.dev-installed
	@set -e; \
	export DATABASE_URL="$$(scripts/ensure_postgres.sh)"; \
	scripts/ensure_redis.sh; \
	command -v chromium >/dev/null || (apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null); \
	command -v pgbouncer >/dev/null || test -x /usr/sbin/pgbouncer || \
	  (apt-get update -qq && \
	   DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer >/dev/null) || \
	  echo "pgbouncer could not be installed: tests/e2e/test_pgbouncer.py will skip"; \
	echo "== ruff"; $(VENV)/bin/ruff check .; $(VENV)/bin/ruff format --check .; \
	echo "== django checks"; $(PY) manage.py check; \
	$(PY) manage.py check --database default; \
	SECRET_KEY="$$(head -c 48 /dev/urandom | base64)" METRICS_TOKEN="$$(head -c 24 /dev/urandom | base64)" \
	  SECRETS_ENCRYPTION_KEYS="$$(head -c 32 /dev/urandom | base64 | tr '+/' '-_')" \
	  DEBUG=0 SECURE_SSL_REDIRECT=1 \
	  SECURE_HSTS_SECONDS=31536000 SECURE_HSTS_INCLUDE_SUBDOMAINS=1 SECURE_HSTS_PRELOAD=1 \
	  ALLOWED_HOSTS=example.com $(PY) manage.py check --deploy --fail-level WARNING; \
	echo "== migrations"; $(PY) manage.py makemigrations --check --dry-run; \
	echo "== migration linter (backward compatibility)"; \
	  LOG_LEVEL=WARNING $(PY) manage.py lintmigrations --quiet ok ignore; \
	echo "== OpenAPI schema"; $(PY) manage.py spectacular --custom-settings deliveries.api.base.SCHEMA_SETTINGS --validate --fail-on-warn >/dev/null; \
	echo "== pytest (PostgreSQL)"; $(VENV)/bin/pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS); \
	echo "== pytest (SQLite: the tests marked sqlite)"; \
	sqlite_dir="$$(mktemp -d)"; trap 'rm -rf "$$sqlite_dir"' EXIT; \
	DATABASE_URL="sqlite:///$$sqlite_dir/webhooks.sqlite3" \
	  $(VENV)/bin/pytest $(PYTEST_PARALLEL) -m sqlite $(PYTEST_ARGS) || [ $$? -eq 5 ]

$(VENV)/.bench-installed: requirements/bench.txt requirements/dev.txt requirements/base.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements/bench.txt
	touch $(VENV)/.base-installed $(VENV)/.dev-installed $@

## make bench: every script a target in docs/benchmarks.md comes from: the admin at 1M
## rows, the harness (bench/run.py: throughput against the bare limits and the peers,
## latency, inbound, growth, background jobs), the fast path's statements per delivery,
## the inbound acknowledgement ramp, backfill memory and slow clients (about 90 minutes in
## all; results in bench/results/).
## make bench BENCH_ARGS=--quick: the harness with small N and one repeat.
bench: $(VENV)/.bench-installed
	@set -e; export DATABASE_URL="$$(scripts/ensure_postgres.sh)"; \
	scripts/ensure_redis.sh; \
	$(PY) bench/admin_log.py; \
	$(PY) bench/run.py $(BENCH_ARGS); \
	$(PY) bench/statements.py; \
	$(PY) bench/ingest.py $(INGEST_BENCH_ARGS); \
	DATABASE_URL="$${DATABASE_URL%/*}/webhooks_bench_backfill" $(PY) bench/backfill_memory.py; \
	$(PY) bench/slow_clients.py

## make soak: the drain-and-count chaos run (docs/reliability.md): 100,000 events and
## 25,000 background jobs through the real commands while they are killed, on a private
## PostgreSQL cluster it starts, restarts once and removes (about 35 minutes on 2 cores).
## SOAK_ARGS="--events 20000 --seed 7" to change it.
soak: $(VENV)/.dev-installed
	$(PY) -m tests.chaos.soak $(SOAK_ARGS)

clean:
	rm -rf $(VENV) var/*.sqlite3*

## make lock: resolve requirements/*.in into the pinned, hashed requirements/*.txt the
## standalone service and the suite install (pip-tools; pins already there are kept,
## `make lock PIP_COMPILE_ARGS=--upgrade` moves them). The package's own ranges are in
## pyproject.toml.
lock: $(VENV)/.dev-installed
	$(PY) -m pip install -q pip-tools==7.6.2
	for f in base otel dev bench; do \
	  $(VENV)/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras \
	    --no-emit-index-url --no-emit-find-links $(PIP_COMPILE_ARGS) \
	    -o requirements/$$f.txt requirements/$$f.in; \
	done
