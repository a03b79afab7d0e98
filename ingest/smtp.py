"""The SMTP listener (``manage.py run_smtp``): mail for one ``smtp`` source, received
with aiosmtpd and stored by ``ingest.receiving.email_receive``.

A session, command by command:

- EHLO announces SIZE (the source's ``max_body_bytes``), STARTTLS when a certificate is
  configured (``SMTP_TLS_CERT_FILE``), and AUTH when the source has credentials (its
  secrets, ``user:password``), which then is required, and only over TLS.
- MAIL FROM: refused with a control character in the address or bad syntax (553), or
  past the sender's rate (450 4.7.1, ``INBOUND_EMAIL_RATE_PER_SENDER`` a minute).
- RCPT TO: only the source's ``addresses`` (550 5.1.1 for any other), at most
  ``SMTP_MAX_RECIPIENTS`` (452 4.5.3), within the recipient's rate (450 4.7.1).
- DATA: the size limit holds while the message arrives (552; the excess is read and
  dropped, never kept). Then, in a thread: the DKIM check when ``SMTP_DKIM_RESOLVER``
  is set, the message's checks and its store, in one transaction. The answer comes
  only after that commit: 250 with the stored id (a duplicate too), 554 5.6.0 for a
  message stored rejected, 451 4.3.0 if the database failed (nothing was stored; the
  sender retries).

So a listener killed between the commit and the answer loses nothing: the sender got
no 250 and sends again, and the copy is a duplicate of what was stored.

Every refusal is counted per reason (``REPLIES`` and ``LIBRARY_REPLIES``, the one table
of what the listener answers), in the process's Prometheus counter and, every few
seconds, in the source's refusal rows. SIGTERM (or SIGINT) stops new connections, lets
the messages being stored be committed and answered (``SMTP_SHUTDOWN_SECONDS``),
answers 421 to every session left and returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import ssl
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from aiosmtpd.smtp import SMTP, AuthResult, LoginPassword
from django.db import close_old_connections, connections
from django.utils import timezone
from django.utils.module_loading import import_string

from deliveries.core.prometheus import INBOUND_REFUSED
from deliveries.jobs.faults import crash_point

from . import mail
from .conf import settings
from .models import InboundEmail, Source
from .receiving import MailReceived, email_receive
from .schemes import MailPost
from .sources import email_throttle, live_secrets, record_refusal, source_for

logger = logging.getLogger("ingest.smtp")

# The listener's own refusals, by reason.
REPLIES = {
    "malformed_address": "553 5.1.3 Malformed address",
    "header_injection": "553 5.1.3 Address holds a control character",
    "sender_rate_limited": "450 4.7.1 Too many messages from this sender, try again later",
    "recipient_refused": "550 5.1.1 No such recipient here",
    "too_many_recipients": "452 4.5.3 Too many recipients",
    "recipient_rate_limited": "450 4.7.1 Too many messages for this recipient, try again later",
    "store_failed": "451 4.3.0 Temporary failure, try again later",
}
# aiosmtpd's refusals, by how their replies start.
LIBRARY_REPLIES = (
    ("552 ", "too_large"),
    ("500 Line too long", "line_too_long"),
    ("553 5.1.3 Error: malformed address", "malformed_address"),
    ("530 5.7.0 Authentication required", "auth_required"),
    ("530 Must issue a STARTTLS", "tls_required"),
    ("538 ", "tls_required"),
    ("535 ", "auth_failed"),
    ("421 4.7.0 ", "command_flood"),
    ("502 5.5.1 Too many unrecognized", "command_flood"),
)
_BY_REPLY = {status: reason for reason, status in REPLIES.items()}
SHUTTING_DOWN = "421 4.3.2 Service shutting down, try again later"
# Commands one session may send: AUTH three times (a password guesser reconnects, and
# every failure is counted), anything else a thousand.
COMMAND_LIMITS = {"AUTH": 3, "*": 1000}
REFRESH_SECONDS = 5.0
NULL_SENDER = "<>"  # as aiosmtpd hands over MAIL FROM:<>


def refusal_reason(status: str) -> str | None:
    """The reason a reply refuses something, or None (a success, or a message stored
    rejected: its reason is counted where it is stored)."""
    if status in _BY_REPLY:
        return _BY_REPLY[status]
    for start, reason in LIBRARY_REPLIES:
        if status.startswith(start):
            return reason
    return None


def quiet_library_log() -> None:
    """Keep aiosmtpd's logger at WARNING unless the host gave it a level of its own.

    At INFO it writes a line per SMTP command, and a host's root logger commonly takes
    INFO: mail from the internet would fill the host's logs with whatever text peers
    send. The listener logs what became of each message itself (``ingest.smtp``,
    ``ingest``); a host that wants the session transcript sets ``mail.log``'s level in
    its ``LOGGING``, and that level is left alone."""
    # aiosmtpd's logger: at INFO a line for every command line a peer sends (its text
    # verbatim) and every connection; at WARNING and above what went wrong in a session.
    library = logging.getLogger("mail.log")
    if library.level == logging.NOTSET:
        library.setLevel(logging.WARNING)


def dkim_resolver() -> Callable | None:
    """The DKIM key lookup ``SMTP_DKIM_RESOLVER`` names: None (no DKIM check), the
    system's resolver (``dns``), or a function(name, timeout) given by dotted path."""
    name = settings.SMTP_DKIM_RESOLVER
    if not name:
        return None
    if name == "dns":
        from dkim.dnsplug import get_txt

        return get_txt
    return import_string(name)


def tls_context() -> ssl.SSLContext | None:
    if not settings.SMTP_TLS_CERT_FILE:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(settings.SMTP_TLS_CERT_FILE, settings.SMTP_TLS_KEY_FILE or None)
    return context


class Listener:
    """One listening socket for the ``smtp`` source ``slug``; ``run`` serves until
    ``stop`` is set. Database work (the source, rate counters, the store) runs in a
    pool of ``SMTP_STORE_THREADS`` threads, never on the event loop."""

    def __init__(self, slug: str, *, host: str | None = None, port: int | None = None) -> None:
        self.slug = slug
        self.host = settings.SMTP_HOST if host is None else host
        self.port = settings.SMTP_PORT if port is None else port
        self.hostname = settings.SMTP_HOSTNAME or socket.gethostname()
        self.tls = tls_context()
        self.dnsfunc = dkim_resolver()
        self.connections: list = []
        self.pool = ThreadPoolExecutor(
            settings.SMTP_STORE_THREADS,
            thread_name_prefix="smtp",
            initializer=self._remember_connection,
        )
        self.sessions: set[Session] = set()
        self.source: Source | None = None
        self.credentials: list[bytes] = []
        self.refusals: Counter = Counter()
        self.refused_from: dict[str, str] = {}
        # What the run did (its LoopRun's counts): messages stored, by outcome, refusals.
        self.counts: Counter = Counter()
        self.bound_port: int | None = None

    # --- Configuration, read in the pool --------------------------------------------

    def _load(self) -> None:
        close_old_connections()
        source = source_for(self.slug)
        if source is not None and source.scheme != "smtp":
            raise ValueError(f"source {self.slug!r} has scheme {source.scheme!r}, not smtp")
        self.credentials = (
            [s.encode() for s in live_secrets(source, timezone.now())] if source else []
        )
        self.source = source

    async def _in_pool(self, func, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, func, *args)

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_SECONDS)
            try:
                await self._in_pool(self._load)
                await self._flush_refusals()
            except RuntimeError:  # the pool is shut down: the process is ending
                return
            except Exception:
                logger.exception("smtp refresh failed", extra={"action": "smtp.refresh"})

    # --- Serving ----------------------------------------------------------------------

    def session(self) -> Session:
        source = self.source
        return Session(
            self,
            # No source (disabled meanwhile): every recipient is refused anyway, and 1, not
            # 0, which aiosmtpd would read as no limit.
            data_size_limit=source.max_body_bytes if source else 1,
            hostname=self.hostname,
            tls_context=self.tls,
            require_starttls=bool(self.tls) and settings.SMTP_REQUIRE_TLS,
            auth_required=bool(self.credentials),
            auth_require_tls=True,
            authenticator=self.authenticate,
            timeout=settings.SMTP_IDLE_TIMEOUT,
            command_call_limit=COMMAND_LIMITS,
        )

    async def run(self, stop: asyncio.Event, ready: Callable[[int], None] | None = None) -> None:
        try:
            await self._in_pool(self._load)
            self._check()
            loop = asyncio.get_running_loop()
            server = await loop.create_server(self.session, self.host, self.port)
            self.bound_port = server.sockets[0].getsockname()[1]
            logger.info(
                "smtp listening",
                extra={"action": "smtp.start", "source": self.slug, "port": self.bound_port},
            )
            if ready is not None:
                ready(self.bound_port)
            refresher = asyncio.ensure_future(self._refresh())
            try:
                await stop.wait()
            finally:
                server.close()
                refresher.cancel()
                await self._drain()
                try:
                    await self._flush_refusals()
                except Exception:  # the database is away: the Prometheus counts stay
                    logger.exception("smtp refusals lost", extra={"action": "smtp.refresh"})
        finally:
            await self._close_pool()
        logger.info("smtp stopped", extra={"action": "smtp.stop", "source": self.slug})

    def _check(self) -> None:
        if self.source is None:
            raise ValueError(f"no enabled smtp source {self.slug!r}")
        if self.credentials and not self.tls:
            raise ValueError(
                "the source has AUTH credentials, which are only taken over TLS: set "
                "SMTP_TLS_CERT_FILE and SMTP_TLS_KEY_FILE"
            )
        if not self.source.verifier.addresses:
            raise ValueError(f"source {self.slug!r} accepts no address: set its 'addresses'")

    async def _drain(self) -> None:
        """Let the messages being stored be committed and answered, then say 421 to
        every session left."""
        deadline = time.monotonic() + settings.SMTP_SHUTDOWN_SECONDS
        while any(s.storing for s in self.sessions) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for session in list(self.sessions):
            await session.goodbye()

    def _remember_connection(self) -> None:
        # Run once in each pool thread: its database connections, closed at the end.
        self.connections.extend(connections.all())

    async def _close_pool(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._end_pool)

    def _end_pool(self) -> None:
        """Wait for the pool's threads, then close the database connections each one
        opened (a connection belongs to its thread, which has ended by then)."""
        self.pool.shutdown(wait=True)
        for wrapper in self.connections:
            wrapper.inc_thread_sharing()
            wrapper.close()

    # --- Refusals ---------------------------------------------------------------------

    def refused(self, reason: str, peer: str) -> None:
        """Count a refusal (on the event loop, as the sessions answer)."""
        self.refusals[reason] += 1
        self.refused_from[reason] = peer
        self.counts["refused"] += 1
        INBOUND_REFUSED.labels(self.slug, reason).inc()

    async def _flush_refusals(self) -> None:
        """The refusals counted since the last flush, into the source's refusal rows.
        Taken on the event loop, where they are counted, so none is lost between."""
        counts, self.refusals = self.refusals, Counter()
        if counts and self.source is not None:
            await self._in_pool(self._write_refusals, self.source, counts, dict(self.refused_from))

    @staticmethod
    def _write_refusals(source: Source, counts: Counter, remotes: dict) -> None:
        close_old_connections()
        for reason, n in counts.items():
            record_refusal(source, reason, remote=remotes.get(reason, ""), n=n)

    # --- The session's hooks ----------------------------------------------------------

    def authenticate(self, server, session, envelope, mechanism, auth_data) -> AuthResult:
        """AUTH PLAIN or LOGIN against the source's credentials, compared in constant
        time with each (no early exit)."""
        if not isinstance(auth_data, LoginPassword):
            return AuthResult(success=False, handled=False)
        offered = auth_data.login + b":" + auth_data.password
        matched = False
        for credential in self.credentials:
            matched |= hmac.compare_digest(offered, credential)
        return AuthResult(success=matched, handled=False, auth_data=auth_data)

    async def handle_MAIL(self, server, session, envelope, address, mail_options):
        # "<>" is the null sender of bounces and auto-replies, which a receiver must take
        # (RFC 5321, 4.5.5); it is stored as an empty sender and has no rate of its own.
        if address != NULL_SENDER:
            if problem := mail.address_problem(address):
                return REPLIES[problem]
            if await self._in_pool(self._throttled, address, ""):
                return REPLIES["sender_rate_limited"]
        envelope.mail_from = address
        envelope.mail_options.extend(mail_options)
        return "250 2.1.0 OK"

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        if problem := mail.address_problem(address):
            return REPLIES[problem]
        source = self.source
        scheme = source.verifier if source is not None else None
        if scheme is None or not mail.accepts(scheme.addresses, address, scheme.separator):
            return REPLIES["recipient_refused"]
        if len(envelope.rcpt_tos) >= settings.SMTP_MAX_RECIPIENTS:
            return REPLIES["too_many_recipients"]
        if await self._in_pool(self._throttled, "", address):
            return REPLIES["recipient_rate_limited"]
        envelope.rcpt_tos.append(address)
        envelope.rcpt_options.extend(rcpt_options)
        return "250 2.1.5 OK"

    def _throttled(self, sender: str, recipient: str) -> bool:
        close_old_connections()
        return email_throttle(self.source, sender=sender, recipient=recipient) is not None

    async def handle_DATA(self, server, session, envelope):
        server.storing = True  # until the answer is written (Session.push)
        peer = session.peer[0] if isinstance(session.peer, tuple) else str(session.peer or "")
        auth = session.auth_data
        login = auth.login.decode("utf-8", "replace") if isinstance(auth, LoginPassword) else ""
        try:
            received = await self._in_pool(
                self._store,
                envelope.mail_from,
                list(envelope.rcpt_tos),
                bytes(envelope.original_content),
                peer,
                session.ssl is not None,
                login,
            )
        except Exception:
            logger.exception(
                "smtp store failed", extra={"action": "smtp.store_failed", "source": self.slug}
            )
            return REPLIES["store_failed"]
        self.counts["messages"] += 1
        self.counts[received.outcome] += 1
        if received.outcome == "rejected":
            return f"554 5.6.0 Message rejected: {received.reason}"
        return f"250 2.0.0 OK: queued as {received.event_ids[0]}"

    def _store(self, mail_from, recipients, raw, peer, tls, login) -> MailReceived:
        close_old_connections()
        evidence = mail.dkim_verdict(raw, self.dnsfunc) if self.dnsfunc else None
        received = email_receive(
            source=self.source,
            post=MailPost(
                raw=raw,
                recipients=tuple(recipients),
                mail_from="" if mail_from == NULL_SENDER else mail_from,
            ),
            transport=InboundEmail.Transport.SMTP,
            remote=peer,
            tls=tls,
            authenticated_as=login,
            evidence=evidence,
        )
        # Committed, not yet answered: a death here must cost the sender a retry, never
        # the message (tests/ingest/test_smtp.py kills the listener here).
        crash_point("smtp.after_commit")
        return received

    async def handle_exception(self, error: Exception) -> str:
        logger.error(
            "smtp session error",
            extra={"action": "smtp.error", "source": self.slug, "error": type(error).__name__},
        )
        return REPLIES["store_failed"]


class Session(SMTP):
    """One client connection: aiosmtpd's protocol, with the listener's bookkeeping
    (its set of sessions, whether a message is being stored, every refusal counted)."""

    def __init__(self, listener: Listener, **kwargs) -> None:
        super().__init__(listener, **kwargs)
        self.listener = listener
        self.storing = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.listener.sessions.add(self)

    def connection_lost(self, error) -> None:
        self.listener.sessions.discard(self)
        super().connection_lost(error)

    async def push(self, status) -> None:
        text = status if isinstance(status, str) else status.decode("ascii", "replace")
        reason = refusal_reason(text)
        if reason:
            peer = self.session.peer if self.session else None
            self.listener.refused(reason, peer[0] if isinstance(peer, tuple) else "")
        try:
            await super().push(status)
        finally:
            self.storing = False

    async def goodbye(self) -> None:
        """421, then close: the sender tries again later (RFC 5321, 3.8)."""
        if self.transport is None or self.transport.is_closing():
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(super().push(SHUTTING_DOWN), timeout=1)
        if self.transport is not None:
            self.transport.close()
