"""The load generator of ``bench/ingest.py``: a separate process, driven over stdin/stdout.

It reads one JSON command per line on stdin and answers one JSON line on stdout:

* ``{"op": "open", "url", "rate", "seconds", "first", "conn_limit", "timeout"}``: the open
  model. ``rate * seconds`` Stripe-signed requests (event ids ``evt_<first>`` onwards,
  one new event each) are built and signed first, untimed; then request *i* is sent at
  ``t0 + i / rate`` whether or not earlier ones were answered, and its latency is taken
  from that *scheduled* time to the end of its response body, so a stalled server shows
  up as latency instead of a slower client (no coordinated omission).
* ``{"op": "prepare", ...}`` with the same fields as the next ``open``: build and sign
  its requests now, so that the caller's timing of ``open`` leaves the signing out.
* ``{"op": "closed", "url", "seconds", "concurrency", "first", "max_requests"}``: a
  closed loop (each of ``concurrency`` senders posts again as soon as it has its
  answer), for the server's maximum throughput.
* ``{"op": "quit"}``.

Both report the status counts, transport errors by type, how many 200 answers said
``"accepted"``, latency percentiles, how late the generator sent (its own health: if it
cannot keep its schedule, it is the bottleneck) and its own CPU seconds during the timed
phase, so the caller can tell how much of the two cores it took.

    python bench/ingest_load.py --secret whsec_bench
"""

import argparse
import asyncio
import json
import resource
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Run as a script, bench/ is sys.path[0], and bench/ingest.py would shadow the project's
# ``ingest`` package.
if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    sys.path[0] = str(ROOT)

from ingest.schemes import get_scheme  # noqa: E402 - after the sys.path fix above

ACCEPTED = b'"accepted"'


def signed_requests(first: int, n: int, secret: str) -> list[tuple[bytes, dict]]:
    """``n`` Stripe events, each a new id and entity, signed now (the receiver refuses
    timestamps more than 300 s off, so build them right before sending)."""
    scheme = get_scheme("stripe")
    now = int(time.time())
    out = []
    for i in range(first, first + n):
        body = json.dumps(
            {
                "id": f"evt_{i}",
                "type": "invoice.paid",
                "created": now,
                "data": {"object": {"id": f"in_{i}"}},
            },
            separators=(",", ":"),
        ).encode()
        out.append((body, scheme.sign(body=body, secret=secret, timestamp=now)))
    return out


def percentiles(values: list[float]) -> dict:
    """Milliseconds: p50, p90, p99, p99.9, max and mean (nearest-rank percentiles)."""
    if not values:
        return {}
    ordered = sorted(values)
    n = len(ordered)

    def rank(q: float) -> float:
        return ordered[min(n - 1, max(0, int(q * n + 0.5) - 1))] * 1000

    return {
        "p50": round(rank(0.50), 2),
        "p90": round(rank(0.90), 2),
        "p99": round(rank(0.99), 2),
        "p99_9": round(rank(0.999), 2),
        "max": round(ordered[-1] * 1000, 2),
        "mean": round(sum(ordered) / n * 1000, 2),
    }


class Tally:
    """What the answers said."""

    def __init__(self) -> None:
        self.statuses: Counter = Counter()
        self.errors: Counter = Counter()
        self.accepted = 0
        self.latencies: list[float] = []
        self.done_at: list[float] = []

    def as_dict(self) -> dict:
        return {
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "errors": dict(self.errors),
            "accepted": self.accepted,
            "ok": sum(v for k, v in self.statuses.items() if 200 <= k < 300),
            "latency_ms": percentiles(self.latencies),
        }


async def _post(session, url: str, body: bytes, headers: dict, tally: Tally, since: float):
    loop = asyncio.get_running_loop()
    try:
        async with session.post(url, data=body, headers=headers) as response:
            answer = await response.read()
            status = response.status
    except Exception as exc:  # every failure is counted by type, none stops the run
        tally.errors[type(exc).__name__] += 1
        return
    now = loop.time()
    tally.statuses[status] += 1
    if status == 200 and ACCEPTED in answer:
        tally.accepted += 1
    tally.latencies.append(now - since)
    tally.done_at.append(now)


def _session(conn_limit: int, timeout: float):
    import aiohttp

    # gunicorn's sync workers close every connection after one response, so there is
    # nothing to keep alive; force_close says so instead of parking dead sockets.
    connector = aiohttp.TCPConnector(limit=conn_limit, force_close=True)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=timeout),
        skip_auto_headers=("User-Agent",),
    )


_prepared: dict = {}


def prepare(cmd: dict, secret: str) -> dict:
    """Build and sign the requests of the next ``open`` command (same ``first``), so that
    the caller can leave the signing out of what it times."""
    n = max(1, round(float(cmd["rate"]) * float(cmd["seconds"])))
    built = time.perf_counter()
    _prepared.clear()
    _prepared[cmd["first"]] = signed_requests(cmd["first"], n, secret)
    return {"op": "prepare", "requests": n, "build_seconds": time.perf_counter() - built}


async def run_open(cmd: dict, secret: str) -> dict:
    rate, seconds = float(cmd["rate"]), float(cmd["seconds"])
    n = max(1, round(rate * seconds))
    built = time.perf_counter()
    requests = _prepared.pop(cmd["first"], None) or signed_requests(cmd["first"], n, secret)
    build_seconds = time.perf_counter() - built
    url, tally, lag = cmd["url"], Tally(), []
    loop = asyncio.get_running_loop()
    async with _session(cmd.get("conn_limit", 2000), cmd.get("timeout", 30.0)) as session:
        interval = 1.0 / rate
        cpu0, t0 = time.process_time(), loop.time() + 0.05
        tasks = []
        for i, (body, headers) in enumerate(requests):
            when = t0 + i * interval
            delay = when - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            # Everything due is started before yielding: an open model sends on schedule.
            lag.append(loop.time() - when)
            tasks.append(loop.create_task(_post(session, url, body, headers, tally, when)))
        sent = loop.time()
        await asyncio.gather(*tasks)
        end = loop.time()
        cpu = time.process_time() - cpu0
    planned_end = t0 + (n - 1) * interval
    last = max(tally.done_at, default=end)
    # Achieved throughput: answers over the time from the first scheduled send to the last
    # answer. A server that keeps up answers the last request one latency after it was
    # sent; one that does not drains its backlog after the schedule ends.
    span = max(last - t0, n * interval)
    out = tally.as_dict()
    out.update(
        op="open",
        offered_per_second=rate,
        requests=n,
        seconds=round(span, 3),
        planned_seconds=round(n * interval, 3),
        drain_after_schedule_seconds=round(max(0.0, last - planned_end), 3),
        ok_per_second=round(out["ok"] / span, 1),
        accepted_per_second=round(tally.accepted / span, 1),
        send_lag_ms=percentiles([max(0.0, x) for x in lag]),
        send_overrun_seconds=round(max(0.0, sent - planned_end), 3),
        generator_cpu_seconds=round(cpu, 3),
        generator_cpu_share=round(cpu / max(end - t0, 1e-9), 3),
        generator_cpu_us_per_request=round(cpu / n * 1e6, 1),
        build_seconds=round(build_seconds, 3),
        completions_per_second=_per_second(tally.done_at, t0),
    )
    return out


async def run_closed(cmd: dict, secret: str) -> dict:
    seconds, concurrency = float(cmd["seconds"]), int(cmd["concurrency"])
    requests = signed_requests(cmd["first"], int(cmd["max_requests"]), secret)
    url, tally = cmd["url"], Tally()
    loop = asyncio.get_running_loop()
    queue = iter(requests)
    async with _session(concurrency, cmd.get("timeout", 30.0)) as session:
        cpu0, t0 = time.process_time(), loop.time()
        deadline = t0 + seconds
        used = 0

        async def sender() -> None:
            nonlocal used
            while loop.time() < deadline:
                item = next(queue, None)
                if item is None:
                    return
                used += 1
                await _post(session, url, item[0], item[1], tally, loop.time())

        await asyncio.gather(*(sender() for _ in range(concurrency)))
        end = loop.time()
        cpu = time.process_time() - cpu0
    out = tally.as_dict()
    out.update(
        op="closed",
        concurrency=concurrency,
        requests=used,
        ran_out_of_requests=used >= len(requests),
        seconds=round(end - t0, 3),
        ok_per_second=round(out["ok"] / (end - t0), 1),
        accepted_per_second=round(tally.accepted / (end - t0), 1),
        generator_cpu_seconds=round(cpu, 3),
        generator_cpu_share=round(cpu / max(end - t0, 1e-9), 3),
        generator_cpu_us_per_request=round(cpu / max(used, 1) * 1e6, 1),
    )
    return out


def _per_second(done_at: list[float], t0: float) -> list[int]:
    counts: Counter = Counter(int(t - t0) for t in done_at)
    return [counts.get(i, 0) for i in range(max(counts, default=-1) + 1)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--secret", required=True)
    args = parser.parse_args(argv)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "prepare":
            answer = prepare(cmd, args.secret)
        else:
            runner = {"open": run_open, "closed": run_closed}[cmd["op"]]
            answer = asyncio.run(runner(cmd, args.secret))
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
