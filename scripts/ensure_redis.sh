#!/usr/bin/env bash
# Makes sure a Redis server answers on 127.0.0.1:6379 (django-q2's Redis broker tests).
# Starts a throwaway one (no persistence) if none answers and redis-server is installed.
set -euo pipefail
if redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then exit 0; fi
if ! command -v redis-server >/dev/null; then
  echo "Redis is not running and redis-server is not installed (apt-get install redis-server)" >&2
  exit 1
fi
echo "starting redis-server on 127.0.0.1:6379" >&2
redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
  --dir /tmp --logfile /tmp/redis-webhooks-test.log >&2
for _ in $(seq 1 20); do
  redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && exit 0
  sleep 0.5
done
echo "redis-server did not start" >&2
exit 1
