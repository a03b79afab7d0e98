"""Inbound abuse against the real HTTP stack: gunicorn with ``project/gunicorn.conf.py``.

``tests/ingest/test_receive.py`` checks each refusal through Django's test client. Slow
uploads, header floods and broken framing only exist on a socket, so here a real gunicorn
(the project's config and worker, bound to an ephemeral port on 127.0.0.1 passed in as
a file descriptor) serves the test database, and raw sockets play the abusers:

* one table of malformed requests, each with the status it must get;
* abuse in parallel with valid signed traffic, which must keep getting 200, each valid
  event stored exactly once.
"""

from __future__ import annotations

import contextlib
import gzip
import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ingest.models import InboundEvent, VerificationFailure
from ingest.schemes import get_scheme
from ingest.sources import source_create
from tests.conftest import subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
SLUG = "abuse"
SECRET = "whsec_test_secret"
MAX_BODY = 64 * 1024
READ_TIMEOUT = 1.0  # GUNICORN_READ_TIMEOUT: a stalled body gets 408 after this
WORKER_TIMEOUT = 4  # GUNICORN_TIMEOUT: a worker held longer is killed and replaced
# GUNICORN_HEADER_TIMEOUT and GUNICORN_BODY_TIMEOUT: a trickled request ends after this.
READ_DEADLINE = 3
WORKERS = 5


@dataclass
class Gunicorn:
    port: int
    proc: subprocess.Popen
    log: Path

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@pytest.fixture
def gunicorn(tmp_path) -> Iterator[Gunicorn]:
    """gunicorn on 127.0.0.1:<ephemeral>, serving the test database; stopped afterwards."""
    source_create(slug=SLUG, scheme="stripe", secrets=[SECRET], max_body_bytes=MAX_BODY)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.set_inheritable(True)
    port = listener.getsockname()[1]
    env = subprocess_env(
        GUNICORN_BIND=f"fd://{listener.fileno()}",
        GUNICORN_WORKERS=str(WORKERS),
        GUNICORN_TIMEOUT=str(WORKER_TIMEOUT),
        GUNICORN_GRACEFUL_TIMEOUT="2",
        GUNICORN_READ_TIMEOUT=str(READ_TIMEOUT),
        GUNICORN_HEADER_TIMEOUT=str(READ_DEADLINE),
        GUNICORN_BODY_TIMEOUT=str(READ_DEADLINE),
        DJANGO_SETTINGS_MODULE="project.settings",
    )
    log = tmp_path / "gunicorn.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", "project/gunicorn.conf.py"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=out,
            pass_fds=(listener.fileno(),),
            start_new_session=True,  # its own process group: the workers go with it
        )
    listener.close()
    server = Gunicorn(port, proc, log)
    try:
        _wait_ready(server)
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_ready(server: Gunicorn, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(f"gunicorn exited:\n{server.tail()}")
        with contextlib.suppress(OSError):
            if exchange(server.port, [b"GET /ingest/abuse/ HTTP/1.1\r\nHost: x\r\n\r\n"]).status:
                return
        time.sleep(0.2)
    raise AssertionError(f"gunicorn not ready:\n{server.tail()}")


@dataclass
class Answer:
    status: int | None  # None: the connection ended without a status line
    body: bytes
    elapsed: float


def exchange(port: int, steps: list[bytes | float], *, timeout: float = 15) -> Answer:
    """Send ``steps`` (bytes are sent, floats are pauses in seconds) on a fresh
    connection, then read the answer until the server closes the connection. A pause ends
    early, and sending stops, as soon as the server answers or closes."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        with contextlib.suppress(OSError):  # the server may answer and close mid-send
            for step in steps:
                if isinstance(step, float):
                    if select.select([conn], [], [], step)[0]:
                        break
                else:
                    conn.sendall(step)
        data = b""
        with contextlib.suppress(OSError):
            while chunk := conn.recv(65536):
                data += chunk
    elapsed = time.monotonic() - started
    status = None
    if data.startswith(b"HTTP/1."):
        status = int(data.split(b" ", 2)[1])
    return Answer(status, data.partition(b"\r\n\r\n")[2], elapsed)


def stripe_body(event_id: str, **extra) -> bytes:
    return json.dumps(
        {
            "id": event_id,
            "object": "event",
            "type": "invoice.paid",
            "created": int(time.time()),
            "data": {"object": {"id": "in_1", **extra}},
        }
    ).encode()


def request(
    body: bytes,
    *,
    sign: bool = True,
    signed_body: bytes | None = None,
    content_type: str = "application/json",
    headers: dict[str, str] | None = None,
    framing: str = "length",
) -> bytes:
    """A raw POST to the source; ``signed_body`` is what the signature covers (default:
    the body). ``framing`` is ``length``, ``none`` (headers only) or ``chunked``."""
    lines = [f"POST /ingest/{SLUG}/ HTTP/1.1", "Host: 127.0.0.1", f"Content-Type: {content_type}"]
    if sign:
        signed = get_scheme("stripe").sign(
            body=body if signed_body is None else signed_body, secret=SECRET
        )
        lines.append(f"Stripe-Signature: {signed['stripe-signature']}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if framing == "length":
        lines.append(f"Content-Length: {len(body)}")
    elif framing == "chunked":
        lines.append("Transfer-Encoding: chunked")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head + (body if framing == "length" else b"")


def valid_post(port: int, event_id: str) -> tuple[int, float]:
    body = stripe_body(event_id)
    headers = get_scheme("stripe").sign(body=body, secret=SECRET)
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", f"/ingest/{SLUG}/", body=body, headers=headers)
        status = conn.getresponse().status
    finally:
        conn.close()
    return status, time.monotonic() - started


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def malformed_cases() -> dict[str, tuple[list[bytes | float], int | None]]:
    """name: (steps, the status it must get)."""
    ok = stripe_body("evt_ok")
    ok_chunked = stripe_body("evt_ok_chunked")
    gz = gzip.compress(stripe_body("evt_gz"))
    big = stripe_body("evt_big", padding="x" * (MAX_BODY + 1))
    return {
        "valid, for contrast": ([request(ok)], 200),
        "valid, chunked": (
            [
                request(b"", signed_body=ok_chunked, framing="chunked"),
                chunk(ok_chunked[:10]),
                chunk(ok_chunked[10:]),
                b"0\r\n\r\n",
            ],
            200,
        ),
        "declared too large, body never sent": (
            [request(b"", headers={"Content-Length": str(10 * MAX_BODY)}, framing="none")],
            413,
        ),
        "too large, chunked with no length": (
            [
                request(b"", framing="chunked"),
                *[chunk(big[i : i + 8192]) for i in range(0, len(big), 8192)],
                b"0\r\n\r\n",
            ],
            413,
        ),
        "body stalls mid-way": (
            [request(b"", headers={"Content-Length": "1000"}, framing="none"), b'{"id":', 5.0],
            408,
        ),
        "header flood (150 headers)": (
            [request(ok, headers={f"X-Flood-{i}": "v" for i in range(150)})],
            431,
        ),
        "one 16 KiB header": ([request(ok, headers={"X-Big": "v" * 16384})], 431),
        "request line too long": (
            [b"POST /ingest/abuse/?" + b"a" * 8000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"],
            414,
        ),
        "chunk size not hex": ([request(b"", framing="chunked"), b"zz\r\nhello\r\n0\r\n\r\n"], 400),
        "chunk without its CRLF": (
            [request(b"", framing="chunked"), b"5\r\nhelloXX0\r\n\r\n"],
            400,
        ),
        "Content-Length and chunked together (smuggling)": (
            [
                request(b"", headers={"Content-Length": "5"}, framing="chunked"),
                chunk(b"hello"),
                b"0\r\n\r\n",
            ],
            400,
        ),
        "two different Content-Lengths": (
            [request(ok, headers={"Content-Length": "3"})],
            400,
        ),
        "NUL in a header": ([request(ok, headers={"X-Nul": "a\x00b"})], 400),
        "gzip body, signed over the gzip bytes": (
            [request(gz, headers={"Content-Encoding": "gzip"})],
            415,
        ),
        "wrong content type": ([request(ok, content_type="text/plain")], 415),
        "bad UTF-8, unsigned": ([request(b'{"id": "\xff\xfe"}', sign=False)], 401),
        "bad UTF-8, signed (authentic but unparseable)": ([request(b'{"id": "\xff\xfe"}')], 400),
        "invalid JSON, signed": ([request(b'{"id": "evt_x", ')], 400),
        "valid body, signature over other bytes": (
            [request(ok, signed_body=stripe_body("evt_other"))],
            401,
        ),
    }


def test_each_malformed_request_gets_its_own_status_from_the_real_server(gunicorn):
    cases = malformed_cases()

    answers = {name: exchange(gunicorn.port, steps) for name, (steps, _) in cases.items()}

    got = {name: answer.status for name, answer in answers.items()}
    assert got == {name: status for name, (_, status) in cases.items()}, gunicorn.tail()
    # The stalled body was answered by the read timeout, not by the client giving up.
    assert READ_TIMEOUT <= answers["body stalls mid-way"].elapsed < 5.0
    # Only the valid event was accepted; the two authentic-but-unparseable bodies were kept
    # as rejected evidence; nothing else created a row.
    assert sorted(InboundEvent.objects.values_list("state", flat=True)) == [
        "enqueued", "enqueued", "rejected", "rejected"
    ]  # fmt: skip
    accepted = InboundEvent.objects.filter(state="enqueued").values_list("event_id", flat=True)
    assert set(accepted) == {"evt_ok", "evt_ok_chunked"}
    counted = dict(VerificationFailure.objects.values_list("reason", "count"))
    assert counted["too_large"] == 2
    assert counted["incomplete_body"] == 1
    assert counted["content_encoding"] == 1
    assert counted["content_type"] == 1


def test_valid_signed_traffic_keeps_getting_200_while_the_server_is_abused(
    gunicorn, record_property
):
    """Slow uploads, a trickler, a slowloris, floods and broken framing, all at once, while
    a steady sender posts valid signed events; every valid one gets 200 and is stored once.

    A stalled body is cut by the read timeout (408); a client trickling under it, or
    trickling its headers, holds one thread until its read deadline (so it never gets a
    2xx). The other threads and workers keep serving.
    """
    stop = threading.Event()
    valid: list[tuple[int, float]] = []
    started_at: list[float] = []  # when each valid request was sent
    sender_errors: list[BaseException] = []

    def sender():
        n = 0
        try:
            while not stop.is_set():
                n += 1
                started_at.append(time.monotonic())
                valid.append(valid_post(gunicorn.port, f"evt_valid_{n}"))
        except BaseException as exc:  # a reset or a timeout is a failure of the test
            sender_errors.append(exc)

    def trickle_body():
        head = request(b"", headers={"Content-Length": "10000"}, framing="none")
        return exchange(gunicorn.port, [head, *[step for _ in range(40) for step in (0.3, b"x")]])

    def slowloris():
        # One header line every 0.3 s, never the blank line that ends them.
        head = request(b"", headers={"Content-Length": "10"}, framing="none")
        lines = [line + b"\r\n" for line in head.split(b"\r\n")[:-2]]
        lines += [f"X-Wait-{i}: 1\r\n".encode() for i in range(30)]
        return exchange(gunicorn.port, [s for line in lines for s in (line, 0.3)])

    def stalled_upload():
        head = request(b"", headers={"Content-Length": "1000"}, framing="none")
        return exchange(gunicorn.port, [head, b"{", 5.0])

    cases = malformed_cases()

    def flood(name: str):
        return [exchange(gunicorn.port, cases[name][0]) for _ in range(10)]

    abusers = {
        "trickle body": trickle_body,
        "slowloris headers": slowloris,
        "stalled upload 1": stalled_upload,
        "stalled upload 2": stalled_upload,
        "header floods": lambda: flood("header flood (150 headers)"),
        "oversized": lambda: flood("declared too large, body never sent"),
        "bad chunks": lambda: flood("chunk size not hex"),
        "gzip": lambda: flood("gzip body, signed over the gzip bytes"),
    }
    results: dict[str, object] = {}
    sending = threading.Thread(target=sender)
    sending.start()
    time.sleep(0.5)  # the sender is going before the abuse starts
    threads = [
        threading.Thread(target=lambda n=n, f=f: results.__setitem__(n, f()))
        for n, f in abusers.items()
    ]
    abuse_began = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    abuse_ended = time.monotonic()
    time.sleep(0.5)
    stop.set()
    sending.join(30)
    after = valid_post(gunicorn.port, "evt_after")

    assert not sending.is_alive() and not sender_errors, sender_errors
    assert not any(t.is_alive() for t in threads)
    during = sum(1 for t in started_at if abuse_began <= t <= abuse_ended)
    record_property("valid_requests_during_abuse", during)
    assert during >= 20, f"only {during} valid requests were sent during the abuse"

    statuses = [status for status, _ in valid]
    slowest = max(elapsed for _, elapsed in valid)
    record_property("valid_requests", len(valid))
    record_property("valid_slowest_seconds", round(slowest, 3))
    for name in ("trickle body", "slowloris headers", "stalled upload 1"):
        record_property(f"{name} status", results[name].status)
        record_property(f"{name} seconds", round(results[name].elapsed, 2))
    assert len(valid) >= 20, f"only {len(valid)} valid requests went through"
    assert statuses == [200] * len(valid), gunicorn.tail()
    assert slowest < 5.0, f"a valid request took {slowest:.2f} s"
    assert after[0] == 200
    assert InboundEvent.objects.filter(event_id__startswith="evt_valid_").count() == len(valid)
    assert results["stalled upload 1"].status == results["stalled upload 2"].status == 408
    for name in ("trickle body", "slowloris headers"):
        answer = results[name]
        assert answer.status is None or answer.status >= 400, (name, answer)
        assert answer.elapsed < WORKER_TIMEOUT + 10, (name, answer)
    assert {a.status for a in results["header floods"]} == {431}
    assert {a.status for a in results["oversized"]} == {413}
    assert {a.status for a in results["bad chunks"]} == {400}
    assert {a.status for a in results["gzip"]} == {415}
