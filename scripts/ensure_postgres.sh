#!/usr/bin/env bash
# Prints a DATABASE_URL for the test suite. Uses $DATABASE_URL when it is set; otherwise
# finds (or starts) the local PostgreSQL server and creates the role and database the
# suite needs. Idempotent. Everything it says goes to stderr except the URL.
set -euo pipefail

if [ -n "${DATABASE_URL:-}" ]; then
  echo "$DATABASE_URL"
  exit 0
fi

HOST=${PGHOST_FOR_TESTS:-127.0.0.1}
PORT=${PGPORT_FOR_TESTS:-5432}
ROLE=${TEST_DB_ROLE:-webhooks}
DB=${TEST_DB_NAME:-webhooks}

if ! pg_isready -q -h "$HOST" -p "$PORT"; then
  echo "PostgreSQL is not answering on $HOST:$PORT; starting the local cluster" >&2
  if command -v pg_ctlcluster >/dev/null && [ -d /etc/postgresql ]; then
    version=$(ls /etc/postgresql | sort -V | tail -n 1)
    pg_ctlcluster --skip-systemctl-redirect "$version" main start >&2 || true
  fi
  for _ in $(seq 1 30); do
    pg_isready -q -h "$HOST" -p "$PORT" && break
    sleep 1
  done
  pg_isready -q -h "$HOST" -p "$PORT" || { echo "PostgreSQL did not start" >&2; exit 1; }
fi

# The local server trusts local connections for the postgres superuser (this machine
# kind's default). Fall back to the OS user postgres through the socket.
psql_admin() {
  if psql -X -q -h "$HOST" -p "$PORT" -U postgres -d postgres -c "SELECT 1" >/dev/null 2>&1; then
    psql -X -q -v ON_ERROR_STOP=1 -h "$HOST" -p "$PORT" -U postgres -d postgres "$@"
  else
    su postgres -c "psql -X -q -v ON_ERROR_STOP=1 -d postgres $(printf '%q ' "$@")"
  fi
}

psql_admin -tAc "SELECT 1 FROM pg_roles WHERE rolname = '$ROLE'" | grep -q 1 \
  || psql_admin -c "CREATE ROLE $ROLE LOGIN CREATEDB" >&2
psql_admin -tAc "SELECT 1 FROM pg_database WHERE datname = '$DB'" | grep -q 1 \
  || psql_admin -c "CREATE DATABASE $DB OWNER $ROLE" >&2

echo "postgres://$ROLE@$HOST:$PORT/$DB"
