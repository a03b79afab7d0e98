"""The egress guard against a hostile receiver, a hostile DNS server and hostile URLs.

``tests/deliveries/test_egress.py`` holds the guard's unit and wire tests (one spelling
per rule, the rebinding answer refused whole, a redirect returned not followed, the 1 GiB
body cut at the cap, a trickle hitting the total timeout). This module adds:

* properties: every refused address form (docs/security.md), spelled every way a URL parser or
  ``inet_aton`` accepts, is refused by ``check_url``, and any DNS answer holding a
  refused record is refused whole;
* the attacks end to end: time-based DNS rebinding against a raw listener on 127.0.0.1
  that counts accepted connections; a redirect to the metadata address through the
  worker pipeline; a 1 GiB response through the pipeline with the process's RSS watched;
  receivers that trickle headers or body against the worker's total timeout.

Network safety: the autouse ``tripwire`` wraps the guard's socket factory (the one place
aiohttp creates sockets) so that any attempt to create a socket for a non-loopback address
fails the test instead of sending a packet. Public addresses appear only in pure checks
and in stub DNS answers; the tripwire records what would have been dialled.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import resource
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from deliveries import services
from deliveries.core import egress as egress_module
from deliveries.core.egress import EgressError, EgressPolicy, ErrorKind
from deliveries.models import Attempt, Delivery
from tests.conftest import drain
from tests.deliveries.test_egress import (
    EVERYTHING_ALLOWED,
    NOTHING_ALLOWED,
    StubResolver,
    session,
)

PROPERTY = hypothesis_settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# --- the tripwire ------------------------------------------------------------------------


class Tripwire:
    def __init__(self) -> None:
        self.dialled: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
        self.stopped: list[str] = []


@pytest.fixture(autouse=True)
def tripwire(monkeypatch) -> Tripwire:
    """No socket for a non-loopback address is ever created by these tests."""
    wire = Tripwire()
    original = egress_module._policy_socket_factory

    def guarded_factory(policy):
        inner = original(policy)

        def create(addr_info):
            ip = ipaddress.ip_address(addr_info[4][0])
            wire.dialled.append(ip)
            if not ip.is_loopback:
                wire.stopped.append(str(ip))
                raise OSError(f"test tripwire: refusing to dial non-loopback {ip}")
            return inner(addr_info)

        return create

    monkeypatch.setattr(egress_module, "_policy_socket_factory", guarded_factory)
    return wire


# --- spellings ---------------------------------------------------------------------------

# One representative of each refused address form, plus the ranges the forms live in.
REFUSED_ADDRESSES = [
    "127.0.0.1", "127.255.255.254", "0.0.0.0", "10.0.0.1", "172.16.0.1", "192.168.1.1",
    "169.254.169.254", "169.254.0.1", "100.64.0.1", "100.100.100.200", "224.0.0.1",
    "240.0.0.1", "255.255.255.255", "::1", "::", "fc00::1", "fe80::1", "fd00:ec2::254",
    "ff02::1", "::ffff:127.0.0.1", "::ffff:7f00:1", "64:ff9b::7f00:1", "2002:7f00:1::1",
    "::7f00:1", "64:ff9b::a9fe:a9fe", "::ffff:169.254.169.254",
]  # fmt: skip
METADATA_ADDRESSES = ["169.254.169.254", "fd00:ec2::254", "100.100.100.200"]
REFUSED_V4_NETWORKS = [
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
    "172.16.0.0/12", "192.168.0.0/16", "224.0.0.0/4", "240.0.0.0/4",
]  # fmt: skip

# Full-width forms (U+FF10…) and the ideographic full stop: IDNA maps them to ASCII.
FULLWIDTH = {ord(c): ord(c) + 0xFEE0 for c in "0123456789abcdefx"} | {ord("."): 0x3002}


def _v4_label(value: int, base: str) -> str:
    return {
        "dec": str(value),
        "hex": hex(value),
        "HEX": hex(value).upper().replace("X", "x"),
        "oct": "0" + oct(value)[2:],
        "pad": f"{value:04d}",
    }[base]


@st.composite
def v4_spelling(draw, ip: ipaddress.IPv4Address) -> str:
    """``ip`` as inet_aton or a browser would read it: 1 to 4 parts, each in any base,
    maybe full-width or with a trailing dot."""
    n = int(ip)
    parts = draw(st.sampled_from([1, 2, 3, 4]))
    octets = list(ip.packed)
    values = {
        1: [n],
        2: [octets[0], n & 0xFFFFFF],
        3: [octets[0], octets[1], n & 0xFFFF],
        4: octets,
    }[parts]
    labels = [
        _v4_label(v, draw(st.sampled_from(["dec", "hex", "HEX", "oct", "pad"]))) for v in values
    ]
    host = ".".join(labels)
    if draw(st.booleans()):
        host += "."
    if draw(st.booleans()):
        host = host.translate(FULLWIDTH)
    return host


@st.composite
def v6_spelling(draw, ip: ipaddress.IPv6Address) -> str:
    """``ip`` bracketed: compressed, exploded, upper-case, zero-padded, with a dotted IPv4
    tail, or with a zone id."""
    form = draw(st.sampled_from(["compressed", "exploded", "upper", "dotted", "zone"]))
    if form == "exploded":
        text = ip.exploded
    elif form == "upper":
        text = ip.compressed.upper()
    elif form == "dotted":
        head = ipaddress.IPv6Address(int(ip) & ~0xFFFFFFFF).exploded.rsplit(":", 2)[0]
        text = f"{head}:{ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)}"
    elif form == "zone":
        text = f"{ip.compressed}%25eth0"
    else:
        text = ip.compressed
    return f"[{text}]"


def spelled(ip_text: str) -> st.SearchStrategy[str]:
    ip = ipaddress.ip_address(ip_text)
    if ip.version == 4:
        return st.one_of(v4_spelling(ip), v6_spelling(ipaddress.IPv6Address(f"::ffff:{ip}")))
    return v6_spelling(ip)


@st.composite
def hostile_url(draw, host: str) -> str:
    """``host`` inside a URL, with the tricks that make parsers disagree about the host."""
    scheme = draw(st.sampled_from(["http", "https", "HTTP", "hTTps"]))
    port = draw(st.sampled_from(["", ":80", ":443", ":8080"]))
    shape = draw(st.sampled_from(["plain", "userinfo", "fragment-at", "query-at", "spaces"]))
    if shape == "userinfo":
        return f"{scheme}://trusted.example.com@{host}{port}/hook"
    if shape == "fragment-at":
        return f"{scheme}://{host}{port}#@trusted.example.com/hook"
    if shape == "query-at":
        return f"{scheme}://{host}{port}?@trusted.example.com/hook"
    if shape == "spaces":
        return f" {scheme}://{host}{port}/hook\t"
    return f"{scheme}://{host}{port}/hook"


def refused_spellings(addresses: list[str]) -> st.SearchStrategy[str]:
    return st.sampled_from(addresses).flatmap(spelled).flatmap(hostile_url)


@PROPERTY
@given(url=refused_spellings(REFUSED_ADDRESSES))
def test_every_spelling_of_every_refused_address_is_refused_before_the_network(url):
    with pytest.raises(EgressError) as info:
        NOTHING_ALLOWED.check_url(url)

    assert info.value.kind in (ErrorKind.BLOCKED, ErrorKind.INVALID_URL)


@PROPERTY
@given(url=refused_spellings(METADATA_ADDRESSES))
def test_every_spelling_of_a_metadata_address_is_refused_even_when_everything_is_allowed(url):
    with pytest.raises(EgressError) as info:
        EVERYTHING_ALLOWED.check_url(url)

    assert info.value.kind in (ErrorKind.BLOCKED, ErrorKind.INVALID_URL)


@PROPERTY
@given(
    url=st.sampled_from(REFUSED_V4_NETWORKS)
    .map(ipaddress.IPv4Network)
    .flatmap(lambda net: st.integers(int(net[0]), int(net[-1])))
    .map(lambda n: str(ipaddress.IPv4Address(n)))
    .flatmap(spelled)
    .flatmap(hostile_url)
)
def test_every_address_in_a_refused_ipv4_range_is_refused_however_spelled(url):
    with pytest.raises(EgressError):
        NOTHING_ALLOWED.check_url(url)


@PROPERTY
@given(
    ip=st.sampled_from(["93.184.216.34", "8.8.8.8", "1.1.1.1"]).map(ipaddress.IPv4Address),
    data=st.data(),
)
def test_only_the_canonical_spelling_of_a_public_address_passes(ip, data):
    """The control: the refusals above are not simply refusing everything. Odd spellings of
    public addresses are refused too (they exist only to confuse filters); the full-width
    form of the canonical spelling is the same host once IDNA has mapped it, so it passes."""
    host = data.draw(v4_spelling(ip), label="host")
    as_ascii = host.translate({v: k for k, v in FULLWIDTH.items()})
    try:
        NOTHING_ALLOWED.check_url(f"https://{host}/hook")
    except EgressError as exc:
        assert as_ascii != str(ip)
        assert exc.kind in (ErrorKind.BLOCKED, ErrorKind.INVALID_URL)
    else:
        assert as_ascii == str(ip)


# --- DNS answers -------------------------------------------------------------------------

public_records = st.sampled_from(["93.184.216.34", "8.8.8.8", "2606:4700::1111"])
refused_records = st.sampled_from(
    [*REFUSED_ADDRESSES, "::ffff:7f00:1", "0:0:0:0:0:ffff:a9fe:a9fe", "64:FF9B::7F00:1"]
)


@hypothesis_settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    answer=st.tuples(st.lists(public_records, max_size=3), refused_records, st.randoms()).map(
        lambda t: t[2].sample([*t[0], t[1]], len(t[0]) + 1)
    ),
    host=st.sampled_from(["rebind.example", "REBIND.example.", "xn--bcher-kva.example"]),
)
def test_any_dns_answer_with_a_refused_record_is_refused_whole_and_nothing_is_dialled(
    answer, host, tripwire
):
    stub = StubResolver(answer)

    async def scenario():
        async with session(NOTHING_ALLOWED, resolver=stub) as egress:
            with pytest.raises(EgressError) as info:
                await egress.post(f"http://{host}/hook", body=b"{}", headers={}, timeout=3.0)
        return info.value

    before = len(tripwire.dialled)
    error = asyncio.run(scenario())

    assert error.kind == ErrorKind.BLOCKED
    assert error.ambiguous is False
    assert len(tripwire.dialled) == before  # refused at resolution, before any socket


@pytest.mark.parametrize("host", ["LOCALHOST", "LocalHost"])
def test_localhost_however_written_is_resolved_by_the_real_resolver_and_refused(host):
    """getaddrinfo answers these from /etc/hosts; the guard refuses the answer. (Not
    ``localhost.``: glibc may send that to the configured DNS server, off this machine.)"""
    with RawListener() as listener:

        async def scenario():
            async with session(NOTHING_ALLOWED) as egress:
                with pytest.raises(EgressError) as info:
                    await egress.post(
                        f"http://{host}:{listener.port}/", body=b"", headers={}, timeout=3.0
                    )
            return info.value

        error = asyncio.run(scenario())

    assert error.kind == ErrorKind.BLOCKED
    assert listener.accepted == 0


# --- a raw listener ----------------------------------------------------------------------


class RawListener:
    """A TCP listener on 127.0.0.1 that counts every connection it accepts and answers any
    HTTP request with ``response`` (then closes). Runs in a thread; stops on exit."""

    def __init__(self, response: bytes = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok") -> None:
        self.response = response
        self.accepted = 0
        self.requests: list[bytes] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.1)
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> RawListener:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            with conn:
                conn.settimeout(2)
                with contextlib.suppress(OSError):
                    self.requests.append(_read_request(conn))
                    conn.sendall(self.response)


def _read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


# --- DNS rebinding -----------------------------------------------------------------------


def test_time_based_rebinding_public_first_then_loopback_never_reaches_the_loopback_listener(
    monkeypatch, tripwire
):
    """The attacker's DNS answers a public address first (TTL 0), loopback afterwards.

    The first answer passes the check and is the address dialled (the tripwire stops that
    socket, standing in for the public host, and records it); every later lookup gets
    loopback and is refused. The listener on 127.0.0.1 never sees a connection, across
    fresh connections and a fresh session, with the DNS cache expiring at once.
    """
    monkeypatch.setattr(egress_module, "_DNS_CACHE_TTL_SECONDS", 0)
    stub = StubResolver(["93.184.216.34"], ["127.0.0.1"])

    with RawListener() as listener:
        url = f"http://rebind.example:{listener.port}/hook"

        async def scenario():
            errors = []
            for _ in range(2):  # two sessions: the second starts with an empty cache
                async with session(NOTHING_ALLOWED, resolver=stub) as egress:
                    for _ in range(3):
                        with pytest.raises(EgressError) as info:
                            await egress.post(url, body=b"x", headers={}, timeout=3.0)
                        errors.append(info.value)
            return errors

        errors = asyncio.run(scenario())

    assert listener.accepted == 0
    assert tripwire.stopped == ["93.184.216.34"]  # the checked address, and only once
    assert errors[0].kind == ErrorKind.CONNECT  # the tripwire's refusal, as a connect error
    assert [e.kind for e in errors[1:]] == [ErrorKind.BLOCKED] * 5
    assert all("127.0.0.1" in e.detail for e in errors[1:])
    assert len(stub.lookups) == 6


def test_rebinding_between_two_allowed_looking_answers_dials_only_what_was_checked(
    monkeypatch, tripwire
):
    """The same attack where the first answer is reachable: 127.0.0.2 stands in for the
    public host (admitted by the allow list), 127.0.0.1 is the target. Every request is
    either delivered to 127.0.0.2 or refused; the 127.0.0.1 listener sees nothing."""
    monkeypatch.setattr(egress_module, "_DNS_CACHE_TTL_SECONDS", 0)
    policy = EgressPolicy(allow_networks=("127.0.0.2/32",))
    stub = StubResolver(["127.0.0.2"], ["127.0.0.1"], ["127.0.0.2"], ["127.0.0.2", "127.0.0.1"])

    with RawListener() as target:
        decoy = socket.create_server(("127.0.0.2", target.port))
        decoy_seen = []

        def serve_decoy():
            decoy.settimeout(5)
            with contextlib.suppress(OSError):
                while True:
                    conn, _ = decoy.accept()
                    with conn:
                        decoy_seen.append(_read_request(conn))
                        conn.sendall(
                            b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
                        )

        thread = threading.Thread(target=serve_decoy, daemon=True)
        thread.start()

        async def scenario():
            results = []
            async with session(policy, resolver=stub) as egress:
                for i in range(4):
                    try:
                        r = await egress.post(
                            f"http://rebind.example:{target.port}/",
                            body=str(i).encode(),
                            headers={},
                            timeout=3.0,
                        )
                        results.append(r.status)
                    except EgressError as exc:
                        results.append(exc.kind)
            return results

        try:
            results = asyncio.run(scenario())
        finally:
            decoy.close()
            thread.join(6)

    assert results == [200, ErrorKind.BLOCKED, 200, ErrorKind.BLOCKED]
    assert target.accepted == 0
    assert len(decoy_seen) == 2
    assert {str(ip) for ip in tripwire.dialled} == {"127.0.0.2"}


# --- the pipeline: redirect, 1 GiB, trickle ----------------------------------------------


@pytest.fixture
def tenant_endpoint(db, make_endpoint):
    def make(url: str, **options):
        endpoint = make_endpoint(url, **options)
        event = services.publish_event(tenant=endpoint.tenant_id, event_type="t", payload={"a": 1})
        return endpoint, Delivery.objects.get(event=event)

    return make


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "location",
    [
        "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
        "http://[fd00:ec2::254]/latest/meta-data/",
        "http://metadata.google.internal/computeMetadata/v1/",
        "LOOPBACK",  # a second listener on loopback, which the allow list admits
    ],
)
def test_a_redirect_to_the_metadata_address_is_recorded_and_never_followed(
    location, tenant_endpoint, tripwire
):
    with RawListener() as second:
        if location == "LOOPBACK":
            location = f"http://127.0.0.1:{second.port}/stolen"
        response = f"HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: 0\r\n\r\n"
        with RawListener(response.encode()) as capture:
            _endpoint, delivery = tenant_endpoint(f"http://127.0.0.1:{capture.port}/hook")
            drain()

    delivery.refresh_from_db()
    [attempt] = Attempt.objects.filter(delivery=delivery)
    assert capture.accepted == 1  # the one delivery, and no second request anywhere
    assert second.accepted == 0
    assert {str(ip) for ip in tripwire.dialled} == {"127.0.0.1"}
    assert tripwire.dialled.count(ipaddress.ip_address("127.0.0.1")) == 1
    assert attempt.status_code == 302
    assert attempt.outcome == "permanent"
    assert delivery.state == "dead"


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


@contextlib.contextmanager
def watch_rss(interval: float = 0.01) -> Iterator[dict]:
    """Sample this process's resident set while the block runs; ``peak`` and ``baseline``."""
    seen = {"baseline": rss_bytes(), "peak": 0}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            seen["peak"] = max(seen["peak"], rss_bytes())
            time.sleep(interval)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(2)
        seen["peak"] = max(seen["peak"], rss_bytes())


class GibibyteServer(RawListener):
    """Answers 200 with ``Content-Length: 1 GiB`` and streams it 64 KiB at a time from one
    reused buffer (never held in memory) until the client hangs up; counts bytes sent."""

    SIZE = 2**30

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0
        self.gave_up = threading.Event()

    def _serve(self) -> None:
        chunk = b"x" * 65536
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            with conn:
                conn.settimeout(10)
                with contextlib.suppress(OSError):
                    self.requests.append(_read_request(conn))
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % self.SIZE)
                    while self.sent < self.SIZE and not self._stop.is_set():
                        conn.sendall(chunk)
                        self.sent += len(chunk)
            self.gave_up.set()


@pytest.mark.django_db(transaction=True)
def test_a_gibibyte_response_is_cut_at_the_cap_without_the_memory_to_hold_it(
    tenant_endpoint, settings, record_property
):
    settings.EGRESS_MAX_RESPONSE_BYTES = 64 * 1024
    with GibibyteServer() as server:
        _endpoint, delivery = tenant_endpoint(f"http://127.0.0.1:{server.port}/hook")
        with watch_rss() as rss:
            started = time.monotonic()
            drain()
            took = time.monotonic() - started
        assert server.gave_up.wait(10)  # the worker hung up instead of draining

    delivery.refresh_from_db()
    [attempt] = Attempt.objects.filter(delivery=delivery)
    growth = rss["peak"] - rss["baseline"]
    record_property("rss_growth_bytes", growth)
    record_property("bytes_sent_before_hang_up", server.sent)
    assert delivery.state == "succeeded"
    assert attempt.status_code == 200
    assert attempt.response_truncated is True
    assert len(attempt.response_body) <= settings.DELIVERY_RESPONSE_BODY_LIMIT
    # What the server got onto the wire before the reset is socket buffers, not the GiB.
    assert server.sent < 64 * 2**20
    assert growth < 64 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB"
    assert took < 30


class Trickler(RawListener):
    """Reads the request, then sends the response one byte every ``gap`` seconds: the
    status line and headers (``phase="headers"``) or, after complete headers, the body."""

    def __init__(self, phase: str, gap: float = 0.2) -> None:
        super().__init__()
        self.phase, self.gap = phase, gap
        self.dropped_at: float | None = None

    def _serve(self) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n"
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            with conn:
                conn.settimeout(2)
                with contextlib.suppress(OSError):
                    self.requests.append(_read_request(conn))
                    if self.phase == "body":
                        conn.sendall(head)
                        head = b""
                    for byte in head or b"x" * 100000:
                        if self._stop.wait(self.gap):
                            break
                        conn.sendall(bytes([byte]))
                self.dropped_at = time.monotonic()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("phase", ["headers", "body"])
def test_a_receiver_that_trickles_hits_the_total_timeout_and_the_retry_keeps_its_id(
    phase, tenant_endpoint
):
    """Each byte arrives well inside any per-read timeout; only the total timeout ends it."""
    with Trickler(phase) as trickler:
        _endpoint, delivery = tenant_endpoint(f"http://127.0.0.1:{trickler.port}/hook", timeout=1.0)
        started = time.monotonic()
        drain()
        took = time.monotonic() - started

    delivery.refresh_from_db()
    [attempt] = Attempt.objects.filter(delivery=delivery)
    assert attempt.error_kind == "timeout"
    assert attempt.ambiguous is True
    assert attempt.outcome == "retry"
    assert delivery.state == "pending"
    assert delivery.attempt_count == 1
    assert took < 10  # a correctness bound: 1 s of timeout, not 100,000 bytes at 0.2 s each
    assert trickler.accepted == 1
    assert f"webhook-id: {delivery.id}".encode() in trickler.requests[0].lower()
