"""CPU per request of the outbound hot path: bare aiohttp against ``EgressSession``.

Not a test: a measurement, run by hand. One invocation

1. starts a small aiohttp receiver on 127.0.0.1 in a subprocess (this file with
   ``--serve``; it answers every POST ``200 ok`` after reading the body);
2. ``--repeat`` rounds; each round runs every case once, in a rotating order, and each
   run sends ``--requests`` POSTs of the same ``--body-bytes`` body from this process,
   ``--concurrency`` in flight, over keep-alive connections. The cases:

   * ``bare``: one ``aiohttp.ClientSession``, no extra headers;
   * ``bare+signed``: the same session with the headers the worker sends
     (``webhook-id``/``-timestamp``/``-signature`` signed by ``deliveries.signing``,
     ``content-type``, ``idempotency-key`` and one custom header);
   * ``egress+signed``: the same headers through ``EgressSession.post`` with
     ``EgressPolicy(allow_networks=(127.0.0.0/8,))``;

3. prints, per case, this process's CPU time (``time.process_time()``) per request in
   microseconds (median and minimum over the rounds) and the median request rate.

Every run first sends ``2 * concurrency`` untimed requests so the connection pool is
warm: what is measured is the steady keep-alive state the worker lives in. Every answer
must be 200 or the run fails.

``--before-egress FILE`` / ``--before-signing FILE`` add the two signed cases again with
the egress and signing modules loaded from those files (an older copy), interleaved with
the current ones so both see the same machine noise::

    cp deliveries/egress.py /tmp/egress_before.py      # before changing them
    cp deliveries/signing.py /tmp/signing_before.py
    .venv/bin/python bench/egress_micro.py \\
        --before-egress /tmp/egress_before.py --before-signing /tmp/signing_before.py

The minimum is the better estimate of the intrinsic cost on a shared machine: other
processes only ever add to a run's CPU time (cache and frequency effects). With two or
more CPUs the receiver is pinned to the last one and this process to the first, so the
two do not take turns on one core. Only 127.0.0.1 is ever contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.util
import ipaddress
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
CUSTOM_HEADERS = {"authorization": "Bearer 3f1c2a9e8b7d6c5f4e3a2b1c0d9e8f7a"}
MODES = ("bare", "bare+signed", "egress+signed")

Send = Callable[[int], Awaitable[int]]


# --- receiver (the subprocess) ----------------------------------------------------------


async def serve() -> None:
    async def hook(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"ok", content_type="text/plain")

    app = web.Application()
    app.router.add_post("/{tail:.*}", hook)
    runner = web.AppRunner(app, access_log=None, handle_signals=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    print(f"listening {runner.addresses[0][1]}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


@contextlib.contextmanager
def receiver(cpu: int | None):
    command = [sys.executable, __file__, "--serve"]
    if cpu is not None:
        command += ["--cpu", str(cpu)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline() if child.stdout else ""
        if not line.startswith("listening "):
            raise RuntimeError(f"receiver did not start: {line!r}")
        yield int(line.split()[1])
    finally:
        child.terminate()
        child.wait(timeout=10)


# --- the client (this process) ----------------------------------------------------------


def load(path: str | None, default: str) -> ModuleType:
    if path is None:
        return importlib.import_module(default)
    name = f"bench_{Path(path).stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def signed_headers(signing: ModuleType, n: int, body: bytes) -> dict[str, str]:
    """What ``deliveries.worker`` sends: custom headers plus the protocol headers, from
    ``signing.delivery_headers`` (a ``--before-signing`` copy must have it)."""
    return signing.delivery_headers(
        CUSTOM_HEADERS, [SECRET], msg_id=f"msg_{n:012d}", timestamp=int(time.time()), body=body
    )


async def run_many(send: Send, start: int, count: int, concurrency: int) -> None:
    """``count`` sends, ``concurrency`` at a time; each must return 200."""
    next_n = start
    end = start + count

    async def lane() -> None:
        nonlocal next_n
        while next_n < end:
            n = next_n
            next_n += 1
            status = await send(n)
            if status != 200:
                raise RuntimeError(f"request {n} answered {status}")

    await asyncio.gather(*(lane() for _ in range(min(concurrency, count))))


@dataclass(frozen=True)
class Case:
    mode: str  # one of MODES
    variant: str  # "current" or "before"
    egress: ModuleType
    signing: ModuleType

    @property
    def label(self) -> str:
        return self.mode if self.mode == "bare" else f"{self.mode} [{self.variant}]"


async def measure(case: Case, args: argparse.Namespace, port: int) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}/hook"
    body = (b'{"data":"' + b"x" * args.body_bytes)[: args.body_bytes - 2] + b'"}'
    signing = case.signing

    async with contextlib.AsyncExitStack() as stack:
        if case.mode.startswith("bare"):
            client = await stack.enter_async_context(
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512))
            )
            signed = case.mode == "bare+signed"

            async def send(n: int) -> int:
                headers = signed_headers(signing, n, body) if signed else None
                async with client.post(url, data=body, headers=headers) as response:
                    await response.read()
                    return response.status

        else:
            policy = case.egress.EgressPolicy(allow_networks=(ipaddress.ip_network("127.0.0.0/8"),))
            egress = await stack.enter_async_context(
                case.egress.EgressSession(
                    policy, max_response_bytes=64 * 1024, connect_timeout=2.0, pool_size=512
                )
            )

            async def send(n: int) -> int:
                response = await egress.post(
                    url, body=body, headers=signed_headers(signing, n, body), timeout=10.0
                )
                return response.status

        await run_many(send, 0, 2 * args.concurrency, args.concurrency)  # warm the pool
        wall, cpu = time.perf_counter(), time.process_time()
        await run_many(send, 10**9, args.requests, args.concurrency)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall

    return {"cpu_us": cpu / args.requests * 1e6, "rps": args.requests / wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--body-bytes", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated")
    parser.add_argument("--before-egress", help="also measure the egress module in this file")
    parser.add_argument("--before-signing", help="also measure the signing module in this file")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    if args.serve:
        with contextlib.suppress(KeyboardInterrupt, web.GracefulExit):
            asyncio.run(serve())
        return 0

    sys.path.insert(0, str(ROOT))
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes: {sorted(unknown)}")
    variants = {"current": (load(None, "deliveries.egress"), load(None, "deliveries.signing"))}
    if args.before_egress or args.before_signing:
        variants["before"] = (
            load(args.before_egress, "deliveries.egress"),
            load(args.before_signing, "deliveries.signing"),
        )
    cases = [
        Case(mode, variant, egress, signing)
        for mode in modes
        for variant, (egress, signing) in variants.items()
        if mode != "bare" or variant == "current"
    ]
    cpus = sorted(os.sched_getaffinity(0))
    pin = not args.no_pin and len(cpus) >= 2
    if pin:
        os.sched_setaffinity(0, {cpus[0]})

    results: dict[str, list[dict[str, float]]] = {case.label: [] for case in cases}
    with receiver(cpus[-1] if pin else None) as port:
        for round_ in range(args.repeat):
            shift = round_ % len(cases)
            for case in cases[shift:] + cases[:shift]:
                results[case.label].append(asyncio.run(measure(case, args, port)))

    print(
        f"{args.requests} POSTs of {args.body_bytes} B, {args.concurrency} in flight, "
        f"{args.repeat} rounds; before: egress={args.before_egress} signing={args.before_signing}"
    )
    print("| case | CPU µs/request, median | min | all runs | requests/s, median |")
    print("| --- | ---: | ---: | --- | ---: |")
    for label, runs in results.items():
        cpu = [r["cpu_us"] for r in runs]
        rps = [r["rps"] for r in runs]
        print(
            f"| {label} | {statistics.median(cpu):.1f} | {min(cpu):.1f} | "
            f"{', '.join(f'{c:.0f}' for c in cpu)} | {statistics.median(rps):,.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
