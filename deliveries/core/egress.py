"""The one door for outbound HTTP: SSRF guard, timeouts, size cap, error kinds.

Every request the service makes to a URL a tenant gave us goes through
:class:`EgressSession`. The rules (docs/security.md, "Egress (SSRF)") and where each is enforced:

* Only ``http``/``https``, no credentials in the URL, a syntactically sane host:
  :meth:`EgressPolicy.check_url`, before anything touches the network.
* IP-literal hosts: aiohttp never calls the resolver for them, so ``check_url``
  judges them itself. Odd IPv4 spellings (``2130706433``, ``0x7f000001``,
  ``0177.0.0.1``, ``127.1``) are refused outright, because ``getaddrinfo``
  happily maps them onto loopback and they only exist to confuse filters.
* Hostnames: resolved once by :class:`_PolicyResolver`, which wraps aiohttp's
  resolver and refuses the whole answer if *any* A/AAAA record is refused (a DNS
  rebinding answer ``[public, 127.0.0.1]`` must not get lucky on ordering). The
  connector then connects only to the records it got from us, so the address
  that was checked is the address that is dialled; there is no second lookup.
  aiohttp's DNS cache holds only answers that already passed the check.
* Belt and braces: the connector's socket factory judges the address of every
  socket it is about to connect, however that address was arrived at. It never
  fires while the checks above hold; it is there so that a later change (a
  followed redirect, a proxy setting) fails closed instead of dialling out.
* Redirects are never followed (``allow_redirects=False``); a 3xx is returned
  to the caller like any other response.
* TLS verification stays on; environment proxies are ignored (``trust_env=False``)
  because a proxy would do its own, unchecked, lookup.
* Cookies are never stored: a shared cookie jar would carry one receiver's
  cookies into the next tenant's deliveries.
* The response body is read up to ``max_response_bytes`` and the connection is
  then closed rather than drained, so a receiver cannot make us download 1 GiB.
* ``EGRESS_ALLOW_NETWORKS`` admits its networks for every request: it is for the
  operator's own receivers. A network opened for one tenant (or one endpoint) is an
  ``EgressAllowance`` row, passed by the caller with that tenant's requests only
  (``allow_networks``), and served by a connection pool of its own.
"""

from __future__ import annotations

import contextvars
import functools
import ipaddress
import logging
import re
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from django.core.exceptions import ImproperlyConfigured, ValidationError
from yarl import URL

from deliveries.core.conf import settings

from .headers import HEADER_NAME

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

USER_AGENT = "trusty-webhooks/1"

logger = logging.getLogger("deliveries.egress")

# Cached answers were checked when they were resolved; a short TTL keeps a
# rebinding attacker's window no wider than an ordinary DNS cache would.
_DNS_CACHE_TTL_SECONDS = 10

# Refused whatever EGRESS_ALLOW_NETWORKS says, even 0.0.0.0/0: these are where
# cloud instance credentials live, and no webhook receiver legitimately sits
# there. 169.254.169.254 is AWS/GCP/Azure/OCI, fd00:ec2::254 is AWS over IPv6,
# 100.100.100.200 is Alibaba Cloud. Link-local as a whole (IPv4 and IPv6) is
# kept out with them: nothing routable lives there and the IPv6 range needs an
# interface scope to reach at all.
_ALWAYS_REFUSED: tuple[tuple[IPNetwork, str], ...] = (
    (ipaddress.ip_network("169.254.169.254/32"), "cloud metadata address"),
    (ipaddress.ip_network("100.100.100.200/32"), "cloud metadata address"),
    (ipaddress.ip_network("fd00:ec2::254/128"), "cloud metadata address"),
    (ipaddress.ip_network("169.254.0.0/16"), "link-local"),
    (ipaddress.ip_network("fe80::/10"), "link-local"),
)

# NAT64 with the well-known prefix (RFC 6052) is how IPv6-only networks reach
# IPv4-only hosts, so it must keep working for public receivers; the address is
# judged exactly as the IPv4 address it carries.
_NAT64_WELL_KNOWN = ipaddress.ip_network("64:ff9b::/96")

# Other IPv6 forms that carry an IPv4 address. Python's ``is_global`` is True
# for several of them even when the embedded address is 127.0.0.1, and the
# embedding (and so what the packet finally reaches) is not always knowable
# from the address alone. No webhook receiver needs them, so they are refused
# outright, and before the allow list so they cannot smuggle a metadata
# address past an allow-everything configuration.
_IPV6_TRANSITION: tuple[tuple[IPNetwork, str], ...] = (
    (ipaddress.ip_network("64:ff9b:1::/48"), "local-use NAT64 prefix (embeds IPv4)"),
    (ipaddress.ip_network("2002::/16"), "6to4 address (embeds IPv4)"),
    (ipaddress.ip_network("2001::/32"), "Teredo address (embeds IPv4)"),
    (ipaddress.ip_network("::ffff:0:0:0/96"), "IPv4-translated address (embeds IPv4)"),
)
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")  # deprecated ::a.b.c.d

# Shared address space: neither ``is_private`` nor ``is_global`` in Python, so
# it needs naming or it slips through a check written as ``is_private``.
_CGNAT = ipaddress.ip_network("100.64.0.0/10")

# WHATWG URL rule: a host whose last label is a number is an IPv4 address, in
# whatever base the label is written. Such a host must be a canonical
# dotted quad or it is one of the odd spellings.
_NUMERIC_LABEL = re.compile(r"^(?:0x[0-9a-f]*|[0-9]+)$")
_HOSTNAME_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")

# Any request's headers: a name that is a token (deliveries.core.headers.HEADER_NAME) and a
# value free of CR, LF and NUL. aiohttp refuses such headers too, but with a bare
# ValueError that is no EgressError. (An endpoint's custom headers are held to the
# stricter rule of deliveries.core.headers before they get here.)
_HEADER_VALUE_FORBIDDEN = re.compile(r"[\r\n\x00]")

# Per-request work that gives the same answer every time is remembered, in bounded
# caches (a miss only costs the work again). URL verdicts are per session, because a
# session has one immutable policy; header names are checked against a fixed rule, so
# one cache serves the process. DNS answers are not cached here: the resolver judges
# every lookup, for every new connection, whatever verdict the URL had.
_URL_VERDICT_CACHE_SIZE = 4096
_HEADER_NAME_CACHE_SIZE = 1024
_CLIENT_TIMEOUT_CACHE_SIZE = 64


class ErrorKind(StrEnum):
    BLOCKED = "blocked"
    DNS = "dns"
    CONNECT = "connect"
    TIMEOUT = "timeout"
    TLS = "tls"
    PROTOCOL = "protocol"
    INVALID_URL = "invalid_url"


@dataclass(frozen=True)
class EgressResponse:
    status: int
    headers: dict[str, str]  # lower-cased names; the last of a repeated header wins
    body: bytes  # at most max_response_bytes
    truncated: bool
    elapsed_ms: float


class EgressError(Exception):
    """A request that produced no usable response.

    ``ambiguous`` is True when the request may have reached the receiver (the
    connection was established before things went wrong), so a retry may be a
    duplicate. ``detail`` is short operator-facing text and never contains a
    response body.
    """

    def __init__(
        self,
        kind: ErrorKind,
        detail: str,
        *,
        ambiguous: bool = False,
        elapsed_ms: float = 0.0,
    ) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail
        self.ambiguous = ambiguous
        self.elapsed_ms = elapsed_ms


@dataclass(frozen=True)
class EgressPolicy:
    """Which destination addresses outbound requests may reach.

    ``allow_networks`` admits addresses that would otherwise be refused (a local
    demo receiver on 127.0.0.1, a receiver in the same VPC). It never admits the
    metadata/link-local addresses or the IPv4-embedding transition ranges.
    Strings are accepted and parsed as CIDRs.
    """

    allow_networks: tuple[IPNetwork, ...] = ()

    def __post_init__(self) -> None:
        networks = tuple(
            ipaddress.ip_network(n) if isinstance(n, str) else n for n in self.allow_networks
        )
        object.__setattr__(self, "allow_networks", networks)

    @classmethod
    def from_settings(cls) -> EgressPolicy:
        """Build the policy from ``settings.EGRESS_ALLOW_NETWORKS``; a bad CIDR fails loudly."""
        networks = []
        for item in getattr(settings, "EGRESS_ALLOW_NETWORKS", ()):
            try:
                # strict: "10.0.0.1/8" is almost certainly a typo, not a wish.
                networks.append(ipaddress.ip_network(str(item).strip()))
            except ValueError as exc:
                raise ImproperlyConfigured(
                    f"EGRESS_ALLOW_NETWORKS: {item!r} is not a CIDR network ({exc})"
                ) from exc
        return cls(allow_networks=tuple(networks))

    def widened(self, networks: tuple[IPNetwork, ...]) -> EgressPolicy:
        """This policy with ``networks`` admitted too (a tenant's egress allowances)."""
        if not networks:
            return self
        return EgressPolicy(allow_networks=self.allow_networks + tuple(networks))

    def refusal(self, ip: IPAddress) -> str | None:
        """Return why ``ip`` must not be contacted, or None if it may be.

        Order matters: addresses embedding IPv4 are unwrapped first, then the
        never-allowed ranges, then the allow list, then the default rules.
        """
        if isinstance(ip, ipaddress.IPv6Address):
            embedded = None
            if ip.ipv4_mapped is not None:
                # A dual-stack socket sends ::ffff:a.b.c.d to a.b.c.d itself.
                embedded, form = ip.ipv4_mapped, "IPv4-mapped"
            elif ip in _NAT64_WELL_KNOWN:
                embedded, form = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF), "NAT64"
            if embedded is not None:
                inner = self.refusal(embedded)
                return f"{form} form of {embedded}: {inner}" if inner else None

        for network, reason in _ALWAYS_REFUSED:
            if ip.version == network.version and ip in network:
                return reason

        if isinstance(ip, ipaddress.IPv6Address):
            for network, reason in _IPV6_TRANSITION:
                if ip in network:
                    return reason
            if ip in _IPV4_COMPATIBLE and int(ip) > 1:  # :: and ::1 are judged below
                return "IPv4-compatible address (embeds IPv4)"

        if any(ip.version == net.version and ip in net for net in self.allow_networks):
            return None
        return _default_refusal(ip)

    def check_url(self, url: str) -> None:
        """Raise :class:`EgressError` (INVALID_URL or BLOCKED) if ``url`` may not be fetched.

        Hostnames pass here and are judged when resolved; IP literals are
        judged here because aiohttp does not resolve them.
        """
        self._checked_url(url)

    def _checked_url(self, url: str | URL) -> URL:
        """Validate ``url`` and return the parsed form that must be sent as-is.

        Handing aiohttp the very ``URL`` object that was checked avoids a
        second parse that could disagree with this one about the host.
        """
        try:
            parsed = url if isinstance(url, URL) else URL(url)
        except (ValueError, TypeError) as exc:
            raise EgressError(ErrorKind.INVALID_URL, f"unparseable URL: {exc}") from None
        if parsed.scheme not in ("http", "https"):
            raise EgressError(ErrorKind.INVALID_URL, f"scheme {parsed.scheme!r} is not http(s)")
        host = (parsed.raw_host or "").lower()
        if not host:
            raise EgressError(ErrorKind.INVALID_URL, "URL has no host")
        if parsed.raw_user is not None or parsed.raw_password is not None:
            # Credentials in URLs end up in logs and attempt history; use headers.
            raise EgressError(ErrorKind.INVALID_URL, "credentials in the URL are not allowed")

        literal = _ip_literal(host)
        if literal is None:
            return parsed
        reason = self.refusal(literal)
        if reason:
            raise EgressError(ErrorKind.BLOCKED, f"address {literal} refused: {reason}")
        return parsed


def match_allowances(
    targets: Iterable[tuple[Any, Any]], rows: Iterable[tuple[Any, Any, str]]
) -> dict[tuple[Any, Any], tuple[IPNetwork, ...]]:
    """The networks opened for each (tenant id, endpoint id or None) target, out of
    ``rows`` of egress allowances (tenant id, endpoint id or None, network): the tenant's
    allowances for all its endpoints, plus the endpoint's own. Never another tenant's: an
    endpoint allowance counts only when its tenant is the target's too. Each tuple is
    sorted, so the same set is the same tuple (``EgressSession`` keys its pools by it)."""
    by_tenant: dict = {}
    for target in set(targets):
        by_tenant.setdefault(target[0], []).append(target)
    found: dict = {target: set() for group in by_tenant.values() for target in group}
    for tenant_id, endpoint_id, network in rows:
        if tenant_id not in by_tenant:
            continue
        try:
            parsed = ipaddress.ip_network(network.strip())
        except ValueError:
            # Only a row written past the model's validation; it opens nothing, and a
            # worker's batch goes on without it.
            logger.error(
                "egress allowance is not a network",
                extra={"action": "egress.bad_allowance", "tenant_id": str(tenant_id)},
            )
            continue
        for target in by_tenant[tenant_id]:
            if endpoint_id in (None, target[1]):
                found[target].add(parsed)
    return {
        target: tuple(sorted(networks, key=lambda n: (n.version, n)))
        for target, networks in found.items()
    }


def validate_endpoint_url(url: str, policy: EgressPolicy | None = None) -> None:
    """ValidationError unless ``policy`` (the endpoint's tenant's: the setting plus what
    staff opened for it, ``selectors.egress_policy_for``; the setting alone by default)
    would let the worker fetch ``url``. The one check of an endpoint's URL: the model's
    ``clean`` (so the admin's form and ``full_clean``), the API serializer and the
    services use it, so nothing can store a URL that every attempt would then refuse."""
    try:
        (policy or EgressPolicy.from_settings()).check_url(url)
    except EgressError as exc:
        raise ValidationError(
            f"This URL cannot receive webhooks: {exc.detail}", code="egress_refused"
        ) from exc


def _default_refusal(ip: IPAddress) -> str | None:
    # Explicit checks before the ``is_global`` catch-all, both for readable
    # reasons and because ``is_global`` is True for multicast and IPv6
    # site-local in Python's tables.
    if ip.is_unspecified:
        return "unspecified address"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if ip.version == 4 and ip in _CGNAT:
        return "shared address space (CGNAT)"
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:
        return "site-local"
    if ip.is_reserved:
        return "reserved range"
    if ip.is_private:
        return "private or special-purpose range"
    if not ip.is_global:
        return "not globally routable"
    return None


def _ip_literal(host: str) -> IPAddress | None:
    """Return the IP a URL host denotes, None for a DNS name, or raise.

    Mirrors aiohttp's own test for "skip the resolver" (a colon, or digits and
    dots), widened to the WHATWG rule for hex and octal labels, so nothing
    aiohttp would connect to directly escapes judgement here.
    """
    if ":" in host:
        try:
            return ipaddress.IPv6Address(host.replace("%25", "%"))
        except ValueError:
            raise EgressError(ErrorKind.INVALID_URL, f"bad IPv6 literal {host!r}") from None

    labels = host.removesuffix(".").split(".")
    if _NUMERIC_LABEL.match(labels[-1]) or host.replace(".", "").isdigit():
        try:
            ip = ipaddress.IPv4Address(host)
        except ValueError:
            ip = None
        if ip is None or str(ip) != host:
            raise EgressError(
                ErrorKind.BLOCKED, f"host {host!r} is a non-canonical spelling of an IPv4 address"
            )
        return ip

    if len(host) > 253 or not all(_HOSTNAME_LABEL.match(label) for label in labels):
        raise EgressError(ErrorKind.INVALID_URL, f"host {host!r} is not a valid hostname")
    return None


class _RefusedAddress(OSError):
    """Raised when the resolver or the socket factory meets a refused address.

    An OSError because that is what aiohttp expects from both; aiohttp then
    wraps it (ClientConnectorDNSError from the resolver, ClientConnectorError
    from the socket factory), and :func:`_translate` digs it back out so it is
    reported as BLOCKED, not as a DNS or connection failure.
    """

    def __init__(self, detail: str) -> None:
        super().__init__(None, detail)
        self.detail = detail


class _PolicyResolver(AbstractResolver):
    """Resolve through ``inner`` and refuse the whole answer if any record is refused."""

    def __init__(self, inner: AbstractResolver, policy: EgressPolicy) -> None:
        self._inner = inner
        self._policy = policy

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        try:
            records = await self._inner.resolve(host, port, family)
        except OSError:
            raise
        except Exception as exc:
            # Fail closed: whatever went wrong, no address is better than a guess.
            raise socket.gaierror(socket.EAI_FAIL, f"resolver failed: {exc!r}") from exc
        if not records:
            raise socket.gaierror(socket.EAI_NONAME, f"no addresses for {host}")
        for record in records:
            try:
                ip = ipaddress.ip_address(record["host"])
            except ValueError:
                raise _RefusedAddress(
                    f"{host} resolved to non-address {record['host']!r}"
                ) from None
            reason = self._policy.refusal(ip)
            if reason:
                raise _RefusedAddress(f"{host} resolved to {ip}, refused: {reason}")
        return records

    async def close(self) -> None:
        # The inner resolver belongs to whoever created it; EgressSession closes its own.
        pass


def _policy_socket_factory(policy: EgressPolicy) -> Callable[[Any], socket.socket]:
    """A socket factory that refuses to create a socket for a refused destination."""

    def create(addr_info: Any) -> socket.socket:
        family, type_, proto, _, sockaddr = addr_info
        try:
            ip = ipaddress.ip_address(sockaddr[0])
        except ValueError:
            raise _RefusedAddress(f"connection to non-address {sockaddr[0]!r}") from None
        reason = policy.refusal(ip)
        if reason:
            raise _RefusedAddress(f"connection to {ip} refused: {reason}")
        return socket.socket(family=family, type=type_, proto=proto)

    return create


class _Attempt:
    """Per-request scratchpad: whether the connector handed this request a connection."""

    __slots__ = ("connected",)

    def __init__(self) -> None:
        self.connected = False


# The attempt of the request running in this task. aiohttp calls the connector from
# inside ``session.request``, in the caller's task, so the connector finds the right
# attempt without per-request trace hooks (whose signal plumbing cost more than the
# rest of the egress checks together); concurrent requests run in separate tasks, each
# with its own context.
_current_attempt: contextvars.ContextVar[_Attempt | None] = contextvars.ContextVar(
    "egress_attempt", default=None
)


class _AttemptMarkingConnector(aiohttp.TCPConnector):
    """A TCPConnector that marks the current attempt connected once it has a connection.

    ``connect`` returns a pooled keep-alive connection or a newly made one (TCP and TLS
    handshakes done); either way the request may reach the receiver from then on. If
    aiohttp retries a request whose reused connection turned out dead, the mark from the
    first try stays: that try may already have been delivered.
    """

    async def connect(self, req: Any, traces: Any, timeout: aiohttp.ClientTimeout) -> Any:
        connection = await super().connect(req, traces, timeout)
        attempt = _current_attempt.get()
        if attempt is not None:
            attempt.connected = True
        return connection


def _find_in_chain(exc: BaseException, cls: type[BaseException]) -> BaseException | None:
    """Find ``cls`` in the explicit wrap chain (``os_error`` and ``__cause__``) of ``exc``."""
    pending: list[BaseException] = [exc]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, cls):
            return current
        for wrapped in (getattr(current, "os_error", None), current.__cause__):
            if isinstance(wrapped, BaseException):
                pending.append(wrapped)
    return None


def _translate(exc: BaseException, attempt: _Attempt, elapsed_ms: float) -> EgressError:
    """Map an aiohttp/OS failure onto an :class:`ErrorKind`.

    Ambiguity follows one rule: the request may have reached the receiver iff
    a connection was established (marked by :class:`_AttemptMarkingConnector`)
    before the failure. So a timeout while resolving or connecting is not
    ambiguous, a timeout while waiting for or reading the response is; a server
    that hangs up after we sent the request is ambiguous. ServerDisconnectedError and
    ClientPayloadError only happen on an established connection, so they are
    ambiguous even if the mark somehow was not set.
    """

    def error(kind: ErrorKind, detail: str, ambiguous: bool = False) -> EgressError:
        return EgressError(kind, detail, ambiguous=ambiguous, elapsed_ms=elapsed_ms)

    refused = _find_in_chain(exc, _RefusedAddress)
    if isinstance(refused, _RefusedAddress):
        return error(ErrorKind.BLOCKED, refused.detail or "address refused")
    if isinstance(exc, aiohttp.ClientSSLError | ssl.SSLError):
        return error(ErrorKind.TLS, f"TLS failure: {exc}", attempt.connected)
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return error(ErrorKind.DNS, f"could not resolve host: {exc.os_error}")
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return error(ErrorKind.TIMEOUT, "timed out connecting")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return error(ErrorKind.CONNECT, f"could not connect: {exc.os_error}")
    if isinstance(exc, aiohttp.InvalidURL):
        return error(ErrorKind.INVALID_URL, f"invalid URL: {exc}")
    if isinstance(exc, TimeoutError):  # asyncio.TimeoutError and aiohttp's timeouts
        phase = "waiting for the response" if attempt.connected else "connecting"
        return error(ErrorKind.TIMEOUT, f"timed out {phase}", attempt.connected)
    surely_sent = isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError)
    return error(
        ErrorKind.PROTOCOL,
        f"{type(exc).__name__}: {exc}"[:300],
        attempt.connected or surely_sent,
    )


async def _read_capped(response: aiohttp.ClientResponse, cap: int) -> tuple[bytes, bool]:
    """Read at most ``cap`` bytes of the body; report whether there was more.

    Reading one byte past the cap is how we learn the body was longer without
    reading the rest of it.
    """
    want = cap + 1
    first = await response.content.read(want)
    if len(first) < want and response.content.at_eof():
        return first, False  # the usual short answer, already complete: no copies
    buffer = bytearray(first)
    while len(buffer) < want:
        chunk = await response.content.read(want - len(buffer))
        if not chunk:
            break
        buffer += chunk
    return bytes(buffer[:cap]), len(buffer) > cap


@functools.lru_cache(maxsize=_HEADER_NAME_CACHE_SIZE)
def _lowered_header_name(name: str) -> str | None:
    """``name`` lower-cased if it is an RFC 9110 token, else None.

    Cached: a worker sends the same few names on every request; only values vary.
    """
    return name.lower() if HEADER_NAME.fullmatch(name) else None


def _headers_to_send(headers: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``headers`` that is safe to send, with our User-Agent unless one is set.

    The copy is what is checked and what is sent, so a caller mutating its mapping
    cannot change a header after the check. Raises EgressError (INVALID_URL) for a name
    that is not a token or a value that is not a string free of CR, LF and NUL.
    """
    checked = dict(headers)
    has_user_agent = False
    for name in checked:
        lowered = _lowered_header_name(name) if isinstance(name, str) else None
        if lowered is None:
            raise _invalid_header(name)
        if lowered == "user-agent":
            has_user_agent = True
    try:
        # One pass over all values at once; join also refuses any value that is not a str.
        values = "".join(checked.values())
    except TypeError:
        values = "\x00"
    if "\r" in values or "\n" in values or "\x00" in values:
        for name, value in checked.items():
            if not isinstance(value, str) or _HEADER_VALUE_FORBIDDEN.search(value):
                raise _invalid_header(name)
    if not has_user_agent:
        checked["User-Agent"] = USER_AGENT
    return checked


def _invalid_header(name: object) -> EgressError:
    # A configuration problem like a bad URL: nothing can be sent.
    return EgressError(ErrorKind.INVALID_URL, f"request header {name!r} is not a valid HTTP header")


class _Pool:
    """What one policy owns inside a session: its aiohttp session (so its connection
    pool and its DNS cache) and its URL verdicts. A connection or a cached answer that
    one policy admitted is never reused under another: a tenant's allowance cannot
    carry over to another tenant's requests through keep-alive or the DNS cache."""

    __slots__ = ("checked_url", "client", "policy")

    def __init__(self, policy: EgressPolicy) -> None:
        self.policy = policy
        # lru_cache remembers only returns, never raises: a refused URL is not cached.
        self.checked_url = functools.lru_cache(maxsize=_URL_VERDICT_CACHE_SIZE)(policy._checked_url)
        self.client: aiohttp.ClientSession | None = None


class EgressSession:
    """Async; one per worker process; keep-alive connection pool.

    Use as ``async with EgressSession() as egress: await egress.post(...)``.
    Arguments left as None come from settings. ``resolver`` is the underlying
    resolver that the policy check wraps (tests inject stubs to simulate DNS
    rebinding); by default aiohttp's ThreadedResolver.

    A request may pass ``allow_networks``: the networks staff opened for its tenant or
    endpoint (``selectors.allowed_networks``), admitted on top of the session's policy
    for that request only. Each distinct set gets a pool of its own (:class:`_Pool`),
    made on first use and kept for the session's life; the sets are staff-made, so they
    are few. A request without one uses the session's policy alone.

    A pool's policy is fixed, so the verdict on a URL string is too: accepted URLs
    are remembered (bounded LRU) and not parsed again. Refused ones are not
    remembered; they are judged afresh each time.
    """

    def __init__(
        self,
        policy: EgressPolicy | None = None,
        *,
        max_response_bytes: int | None = None,
        connect_timeout: float | None = None,
        pool_size: int = 512,
        pool_size_per_host: int = 0,
        resolver: AbstractResolver | None = None,
    ) -> None:
        self._policy = policy if policy is not None else EgressPolicy.from_settings()
        self._max_response_bytes = (
            max_response_bytes
            if max_response_bytes is not None
            else settings.EGRESS_MAX_RESPONSE_BYTES
        )
        self._connect_timeout = (
            connect_timeout if connect_timeout is not None else settings.EGRESS_CONNECT_TIMEOUT
        )
        if self._max_response_bytes < 0 or self._connect_timeout <= 0:
            raise ValueError("max_response_bytes must be >= 0 and connect_timeout > 0")
        self._pool_size = pool_size
        self._pool_size_per_host = pool_size_per_host
        self._inner_resolver = resolver
        self._owns_resolver = resolver is None
        self._closed = False
        # By the networks a request adds; () is the session's policy alone.
        self._pools: dict[tuple[IPNetwork, ...], _Pool] = {(): _Pool(self._policy)}
        self._client_timeouts: dict[float, aiohttp.ClientTimeout] = {}

    async def __aenter__(self) -> EgressSession:
        self._ensure_session(self._pools[()])
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        for pool in self._pools.values():
            if pool.client is not None:
                await pool.client.close()
                pool.client = None
        if self._owns_resolver and self._inner_resolver is not None:
            await self._inner_resolver.close()
            self._inner_resolver = None

    async def post(
        self,
        url: str,
        *,
        body: bytes,
        headers: Mapping[str, str],
        timeout: float,
        allow_networks: tuple[IPNetwork, ...] = (),
    ) -> EgressResponse:
        """POST ``body``; return any HTTP response (3xx included) or raise EgressError.

        A URL or header that cannot be sent is INVALID_URL; nothing reaches the network.
        ``allow_networks`` widens the policy for this request (the class docstring).
        """
        return await self._request(
            "POST",
            url,
            body=body,
            headers=headers,
            timeout=timeout,
            pool=self._pool(allow_networks),
        )

    async def get(
        self,
        url: str,
        *,
        headers: Mapping[str, str],
        timeout: float,
        allow_networks: tuple[IPNetwork, ...] = (),
    ) -> EgressResponse:
        """GET under the same rules as :meth:`post`."""
        return await self._request(
            "GET", url, body=None, headers=headers, timeout=timeout, pool=self._pool(allow_networks)
        )

    def _pool(self, allow_networks: tuple[IPNetwork, ...]) -> _Pool:
        pool = self._pools.get(allow_networks)
        if pool is None:
            pool = self._pools[allow_networks] = _Pool(self._policy.widened(allow_networks))
        return pool

    def _ensure_session(self, pool: _Pool) -> aiohttp.ClientSession:
        # Created lazily because aiohttp binds connectors to the running loop.
        if self._closed:
            raise RuntimeError("EgressSession is closed")
        if pool.client is None:
            if self._inner_resolver is None:
                self._inner_resolver = aiohttp.ThreadedResolver()
            connector = _AttemptMarkingConnector(
                limit=self._pool_size,
                limit_per_host=self._pool_size_per_host,
                ttl_dns_cache=_DNS_CACHE_TTL_SECONDS,
                resolver=_PolicyResolver(self._inner_resolver, pool.policy),
                socket_factory=_policy_socket_factory(pool.policy),
                ssl=True,
            )
            pool.client = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=False,
            )
        return pool.client

    def _client_timeout(self, timeout: float) -> aiohttp.ClientTimeout:
        """The (immutable, so shareable) ClientTimeout for a total of ``timeout`` seconds."""
        client_timeout = self._client_timeouts.get(timeout)
        if client_timeout is None:
            if len(self._client_timeouts) >= _CLIENT_TIMEOUT_CACHE_SIZE:
                self._client_timeouts.clear()
            client_timeout = aiohttp.ClientTimeout(
                total=timeout, connect=min(self._connect_timeout, timeout)
            )
            self._client_timeouts[timeout] = client_timeout
        return client_timeout

    async def _request(
        self,
        method: str,
        url: str,
        *,
        body: bytes | None,
        headers: Mapping[str, str],
        timeout: float,
        pool: _Pool,
    ) -> EgressResponse:
        if not timeout > 0:  # written so that NaN is refused too
            raise ValueError("timeout must be positive")
        started = time.perf_counter()
        try:
            target = pool.checked_url(url)
            request_headers = _headers_to_send(headers)
        except EgressError as exc:
            exc.elapsed_ms = (time.perf_counter() - started) * 1000
            raise

        session = self._ensure_session(pool)
        attempt = _Attempt()
        attempt_token = _current_attempt.set(attempt)
        try:
            async with session.request(
                method,
                target,
                data=body,
                headers=request_headers,
                allow_redirects=False,
                timeout=self._client_timeout(timeout),
            ) as response:
                content, truncated = await _read_capped(response, self._max_response_bytes)
                if truncated:
                    # Do not drain the rest to reuse the connection: that is
                    # exactly the download the cap exists to prevent.
                    response.close()
                return EgressResponse(
                    status=response.status,
                    headers={name.lower(): value for name, value in response.headers.items()},
                    body=content,
                    truncated=truncated,
                    elapsed_ms=(time.perf_counter() - started) * 1000,
                )
        except (aiohttp.ClientError, OSError) as exc:
            # OSError includes TimeoutError (asyncio's and aiohttp's) and ssl.SSLError.
            elapsed_ms = (time.perf_counter() - started) * 1000
            raise _translate(exc, attempt, elapsed_ms) from exc
        finally:
            _current_attempt.reset(attempt_token)
