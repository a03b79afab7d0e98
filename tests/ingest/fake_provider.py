"""A fake provider API for the polling and backfill tests: real HTTP on 127.0.0.1, an
ephemeral port, a thread that stops with the fixture.

``GET /records?updated_since=<ISO>&limit=<n>&page_token=<t>`` answers
``{"data": [...], "next": <token or null>, "server_time": <ISO>, "total": <n>}`` with the
records whose ``updated_at >= updated_since`` in ``(updated_at, id)`` order, keyset
paginated (a token is the position after the last record sent, stable under writes).

Two datasets:

- :class:`LiveRecords`: records inserted and updated while polls run. Its clock runs
  ``skew`` seconds behind ours and stamps in ``tick_ms`` ticks, so many records share one
  ``updated_at``; ``server_time`` is that clock at the same granularity. It logs every
  version written, and updates only records whose current version was served after its
  tick ended, so that every version written can be read by some poll.
- :class:`StaticRecords`: ``n`` records computed, not stored (``per_ts`` per timestamp,
  one second apart), for backfills of 100,000 records.
"""

from __future__ import annotations

import bisect
import json
import random
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

BASE = datetime(2024, 1, 1, tzinfo=UTC)
BASE_MS = int(BASE.timestamp() * 1000)


def iso_ms(ms: int) -> str:
    return (
        datetime.fromtimestamp(ms / 1000, UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


def parse_ms(value: str) -> int:
    """An ISO time to whole milliseconds, rounded up (``>=`` stays ``>=``)."""
    dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    us = int(dt.timestamp()) * 1_000_000 + dt.microsecond
    return -(-us // 1000)


class LiveRecords:
    def __init__(self, *, skew: float = 1.0, tick_ms: int = 50, seed: int = 7) -> None:
        self.lock = threading.Lock()
        self.skew, self.tick_ms = skew, tick_ms
        self.current: dict[str, int] = {}  # id -> updated_at (ms)
        self.index: list[tuple[int, str]] = []  # (updated_at, id), sorted
        self.written: list[str] = []  # every version, as "<id>@<updated_at>"
        self.served: set[str] = set()
        self.served_current: set[str] = set()  # ids whose current version was served
        self._next_id = 0
        self._last_ms = 0
        self._random = random.Random(seed)

    def now_ms(self) -> int:
        ms = int((time.time() - self.skew) * 1000)
        self._last_ms = max(self._last_ms, ms - ms % self.tick_ms)
        return self._last_ms

    def write(self, inserts: int, updates: int) -> None:
        """One write at one provider time: ``inserts`` new records and ``updates`` of
        existing ones whose current version was served (so every version can be seen)."""
        with self.lock:
            ts = self.now_ms()
            candidates = [rid for rid in self.served_current if self.current[rid] != ts]
            chosen = self._random.sample(candidates, min(updates, len(candidates)))
            for rid in chosen:
                self.index.remove((self.current[rid], rid))
                self._put(rid, ts)
            for _ in range(inserts):
                self._next_id += 1
                self._put(f"r{self._next_id:07d}", ts)

    def _put(self, rid: str, ts: int) -> None:
        self.current[rid] = ts
        self.served_current.discard(rid)
        bisect.insort(self.index, (ts, rid))
        self.written.append(f"{rid}@{iso_ms(ts)}")

    def page(self, since_ms: int, token: str | None, limit: int) -> dict:
        with self.lock:
            now = self.now_ms()
            if token:
                ts, rid, began = token.split(":")
                start = bisect.bisect_right(self.index, (int(ts), rid))
                began = int(began)
            else:
                start = bisect.bisect_left(self.index, (since_ms, ""))
                began = now  # the listing's start, carried in its page tokens
            rows = self.index[start : start + limit]
            data = []
            for ts, rid in rows:
                if ts < began:
                    # Served settled: its tick was over when the listing began. Only then
                    # may the writer replace it, so every version written can be read.
                    self.served.add(f"{rid}@{iso_ms(ts)}")
                    self.served_current.add(rid)
                data.append({"id": rid, "updated_at": iso_ms(ts), "name": f"record {rid}"})
            more = start + limit < len(self.index)
            return {
                "data": data,
                "next": f"{rows[-1][0]}:{rows[-1][1]}:{began}" if rows and more else None,
                "server_time": iso_ms(now),
            }


class StaticRecords:
    def __init__(self, n: int, per_ts: int = 10) -> None:
        self.n, self.per_ts = n, per_ts

    def record(self, i: int) -> dict:
        return {
            "id": f"r{i:07d}",
            "updated_at": iso_ms(BASE_MS + (i // self.per_ts) * 1000),
            "name": f"record {i}",
            "amount": i * 7 % 1000,
        }

    def page(self, since_ms: int, token: str | None, limit: int) -> dict:
        if token:
            start = int(token)
        else:
            seconds = max(0, -(-(since_ms - BASE_MS) // 1000))
            start = min(seconds * self.per_ts, self.n)
        end = min(start + limit, self.n)
        return {
            "data": [self.record(i) for i in range(start, end)],
            "next": str(end) if end < self.n else None,
            "total": None if token else self.n - start,
            "server_time": iso_ms(BASE_MS + (self.n // self.per_ts + 10) * 1000),
        }


class FakeProvider:
    """The HTTP server. ``requests`` holds (monotonic time, path) of every request;
    ``fail_next`` makes the next requests answer that status."""

    def __init__(self, records, *, token: str = "Bearer test-token") -> None:
        self.records = records
        self.token = token
        self.requests: list[tuple[float, str]] = []
        self.fail_next: list[int] = []
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                provider.requests.append((time.monotonic(), self.path))
                url = urlsplit(self.path)
                if url.path != "/records":
                    return self._send(404, {"error": "not found"})
                if provider.token and self.headers.get("Authorization") != provider.token:
                    return self._send(401, {"error": "unauthorized"})
                if provider.fail_next:
                    return self._send(provider.fail_next.pop(0), {"error": "try later"})
                q = {k: v[0] for k, v in parse_qs(url.query).items()}
                since = parse_ms(q["updated_since"]) if "updated_since" in q else 0
                body = provider.records.page(since, q.get("page_token"), int(q.get("limit", 100)))
                self._send(200, body)

            def _send(self, status, body):
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/records"

    def start(self) -> FakeProvider:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    def config(self, **overrides) -> dict:
        """Poll settings for this API."""
        return {
            "url": self.url,
            "server_time_path": "server_time",
            "total_path": "total",
            **overrides,
        }
