"""Inbound webhook signature schemes: verify, parse and describe one provider's requests.

Each provider is one small class behind the :class:`Scheme` interface. The receive view
builds a :class:`Request` from the raw bytes and the (lower-cased) headers, then calls

1. ``verify(request, secrets=..., now=...)`` — raises :class:`VerificationFailed` with a
   stable ``reason``; nothing is parsed before this passes;
2. ``parse(request)`` — raises :class:`UnparseableBody` (a ``ValueError``);
3. ``extract(request, parsed)`` — the :class:`EventMeta` used for dedupe and ordering.

The module is pure: no database, no settings, and verification reads no clock (``now`` is
passed in), so the same code serves the view, the tests and the benchmarks (each scheme
can also ``sign`` a request the way its provider would).

Verification rules shared by every scheme:

- the MAC is computed over the raw bytes exactly as received, never re-serialised JSON;
- every configured secret is tried (rotation) against every offered signature, and every
  pair is compared with :func:`hmac.compare_digest` (no early exit);
- timestamped schemes refuse ``|now - ts| > tolerance`` in both directions, checked after
  the signature, so ``stale_timestamp``/``future_timestamp`` only ever describe authentic
  requests (a replay or a skewed clock) while forgeries count as ``bad_signature``;
- ``missing_signature`` means the signature header is absent or blank; anything present
  but unusable (bad syntax, no entry of the version we verify, a timestamp that is not
  plain ASCII digits, a signature that does not decode to a digest of the right length
  or is not canonical base64) is ``malformed_signature``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import re
import string
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email import policy as email_policy
from email.parser import BytesParser
from typing import Any, ClassVar
from urllib.parse import parse_qs

from deliveries.core.text import text_problem

REASONS = frozenset(
    {
        "missing_signature",
        "malformed_signature",
        "bad_signature",
        "missing_timestamp",
        "stale_timestamp",
        "future_timestamp",
        "no_secret",
        # Mail providers' posts (basic auth, an optional IP allow-list, Mailgun's tokens).
        "ip_not_allowed",
        "insecure_transport",
        "replayed_token",
    }
)

# Longer ids are refused as unparseable rather than truncated (a truncated id could merge
# two distinct events under one dedupe key).
MAX_EVENT_ID_LENGTH = 255

_JSON = "application/json"
_FORM = "application/x-www-form-urlencoded"
_TIMESTAMP = re.compile(r"[0-9]{1,12}")  # ASCII digits only: str.isdigit() accepts "²"
_HEX = re.compile(r"[0-9a-fA-F]+")
# What may begin a signature header value (after the server strips whitespace).
_PREFIX = re.compile(r"[!-~][ -~]*")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")  # an RFC 9110 token, lower-cased


@dataclass(frozen=True)
class Request:
    """What the receive view hands over."""

    headers: Mapping[str, str]  # names lower-cased
    body: bytes  # the raw bytes, exactly as received
    remote: str = ""  # the peer's address (REMOTE_ADDR), for IP allow-lists
    secure: bool = True  # whether it came over HTTPS (basic auth needs it)


class VerificationFailed(Exception):
    """The request is not authentic (or not checkable); ``reason`` is one of ``REASONS``."""

    def __init__(self, reason: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown verification failure reason {reason!r}")
        super().__init__(reason)
        self.reason = reason


class UnparseableBody(ValueError):
    """An authentic body that cannot be parsed or lacks the provider's event id."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class EventMeta:
    event_id: str  # the provider's id, used for dedupe
    event_type: str  # "" if unknown
    occurred_at: datetime | None  # the event's own time (aware UTC) when the provider says
    entity_id: str  # "" if none; the key of the entity lock that orders handlers

    def __post_init__(self) -> None:
        # Each becomes a text column. NUL (PostgreSQL refuses it) or a lone surrogate
        # (UTF-8 cannot encode it) would fail the insert on every retry of the provider;
        # refused here, the body is stored as rejected evidence instead. Reason:
        # "nul_in_event_id", "surrogate_in_entity_id", ...
        for name in ("event_id", "event_type", "entity_id"):
            if problem := text_problem(getattr(self, name)):
                raise UnparseableBody(f"{problem}_in_{name}")


# --- shared primitives ---------------------------------------------------------------


def _hmac(key: bytes, msg: bytes, algorithm: str) -> bytes:
    return hmac.new(key, msg, algorithm).digest()


def _any_match(candidates: Iterable[bytes], expected: Iterable[bytes]) -> bool:
    """True when any candidate equals any expected MAC; every pair is compared in constant
    time and there is no early exit, so timing says nothing about which pair matched."""
    wanted = list(expected)
    matched = False
    for candidate in candidates:
        for good in wanted:
            matched |= hmac.compare_digest(candidate, good)
    return matched


def _check_window(ts: int, now: float, tolerance: int) -> None:
    if now - ts > tolerance:
        raise VerificationFailed("stale_timestamp")
    if ts - now > tolerance:
        raise VerificationFailed("future_timestamp")


def _timestamp(value: str | None) -> str:
    """The timestamp header as sent (it is part of the signed content), checked to be a
    plain unix time in seconds."""
    if value is None or not value.strip():
        raise VerificationFailed("missing_timestamp")
    value = value.strip()
    if not _TIMESTAMP.fullmatch(value):
        raise VerificationFailed("malformed_signature")
    return value


def _signature_header(request: Request, name: str) -> str:
    value = request.headers.get(name)
    if value is None or not value.strip():
        raise VerificationFailed("missing_signature")
    return value.strip()


def _decode_hex(value: str) -> bytes | None:
    return bytes.fromhex(value) if _HEX.fullmatch(value) and len(value) % 2 == 0 else None


def _decode_base64(value: str) -> bytes | None:
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError:  # binascii.Error, and non-ASCII text
        return None
    # b64decode ignores the unused low bits of the last character, so "…OE=" and "…OF="
    # decode alike; only the canonical spelling is accepted, so a signature has one form.
    return raw if base64.b64encode(raw).decode() == value else None


def _encode(mac: bytes, encoding: str) -> str:
    return mac.hex() if encoding == "hex" else base64.b64encode(mac).decode()


def _text(value: str) -> bytes:
    try:
        return value.encode()
    except UnicodeEncodeError:  # lone surrogates cannot be what the sender signed
        raise VerificationFailed("malformed_signature") from None


def _dig(obj: Any, path: str) -> Any:
    """``obj["a"]["b"]`` for ``path="a.b"``; None when any step is missing."""
    for step in path.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(step)
    return obj


def _str(value: Any) -> str:
    """A JSON string or integer as text; anything else (bool, float, object) as ""."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return ""


def _from_unix(value: Any) -> datetime | None:
    if isinstance(value, str) and _TIMESTAMP.fullmatch(value):
        value = int(value)
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        return datetime.fromtimestamp(value, UTC)
    except (OverflowError, OSError, ValueError):
        return None


def _from_iso(value: Any) -> datetime | None:
    """An ISO 8601 time as aware UTC (naive times are taken as UTC); None if unparseable.
    Python 3.11 accepts a trailing ``Z`` and truncates digits past microseconds."""
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        return parsed.replace(tzinfo=UTC)
    try:
        return parsed.astimezone(UTC)
    except OverflowError:
        return None


def _event_id(value: Any) -> str:
    event_id = _str(value)
    if not event_id:
        raise UnparseableBody("missing_event_id")
    if len(event_id) > MAX_EVENT_ID_LENGTH:
        raise UnparseableBody("event_id_too_long")
    return event_id


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: "[[[[…" nested past the limit
        raise UnparseableBody("invalid_json") from None


def _parse_form(body: bytes) -> dict[str, str]:
    """A form body as its first value per field."""
    try:
        text = body.decode()
    except UnicodeDecodeError:
        raise UnparseableBody("invalid_form") from None
    return {k: v[0] for k, v in parse_qs(text, keep_blank_values=True).items()}


def _is_form(request: Request) -> bool:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type in (_JSON, _FORM):
        return content_type == _FORM
    return not request.body.lstrip().startswith(b"{")


def _now(timestamp: int | None) -> int:
    return int(time.time()) if timestamp is None else timestamp


# --- the interface ---------------------------------------------------------------------


class Scheme:
    """One provider's signature scheme. Instances are immutable and safe to share.

    Subclasses say where the signatures and the signed content come from
    (``_offered``); verification itself is shared.
    """

    name: ClassVar[str]
    content_types: ClassVar[tuple[str, ...]] = (_JSON,)
    algorithm: str = "sha256"
    # Whether the event id ``extract`` returns is covered by the signature (in the signed
    # body or the signed content). When it is not, anyone holding one genuine request can
    # resend it under a fresh id; the receive view then dedupes on the body's hash too.
    signs_event_id: bool = True
    # Mail sources (EmailScheme): the receive paths store their posts as inbound emails.
    is_email: ClassVar[bool] = False
    # A new source's body-size limit unless told otherwise.
    default_max_body_bytes: ClassVar[int] = 1024 * 1024

    def __init__(self, **options: Any) -> None:
        if options:
            raise ValueError(f"the {self.name!r} scheme takes no options, got {sorted(options)}")

    def signing_key(self, secret: str) -> bytes:
        """The HMAC key for a configured secret; ValueError if it cannot be one (forms
        that store secrets can call this to refuse them early)."""
        if not secret:
            raise ValueError("empty secret")
        return secret.encode()

    def verify(
        self, request: Request, *, secrets: Sequence[str], now: float, tolerance: int = 300
    ) -> None:
        """Raise VerificationFailed unless some offered signature matches some secret and,
        for timestamped schemes, the timestamp is within ``tolerance`` seconds of ``now``.

        Secrets that cannot be keys (empty, or not base64 where the scheme needs it) are
        skipped; with none left the reason is ``no_secret``.
        """
        keys = self._keys(secrets)
        candidates, timestamp, content = self._offered(request)
        if not _any_match(candidates, (_hmac(k, content, self.algorithm) for k in keys)):
            raise VerificationFailed("bad_signature")
        if timestamp is not None:
            _check_window(int(timestamp), now, tolerance)

    def _keys(self, secrets: Sequence[str]) -> list[bytes]:
        """The keys of the configured secrets that can be keys; ``no_secret`` if none."""
        if isinstance(secrets, str | bytes):
            # A bare string is a Sequence of one-character secrets: refuse, loudly.
            raise TypeError("secrets must be a sequence of secrets, not one string")
        keys = []
        for secret in secrets:
            try:
                keys.append(self.signing_key(secret))
            except ValueError:
                continue
        if not keys:
            raise VerificationFailed("no_secret")
        return keys

    def _offered(self, request: Request) -> tuple[list[bytes], str | None, bytes]:
        """(offered MACs, timestamp as sent or None, signed content); raises
        VerificationFailed for missing or malformed headers."""
        raise NotImplementedError

    def parse(self, request: Request) -> Any:
        """The body as JSON; call only after ``verify``."""
        return _parse_json(request.body)

    def extract(self, request: Request, parsed: Any) -> EventMeta:
        raise NotImplementedError

    def sign(
        self,
        *,
        body: bytes,
        secret: str,
        timestamp: int | None = None,
        event_id: str = "",
        event_type: str = "",
    ) -> dict[str, str]:
        """The (lower-cased) headers the provider would send with ``body``.

        ``timestamp`` defaults to the current time for timestamped schemes.
        ``event_id``/``event_type`` fill the headers that carry them, for the schemes
        that carry them in headers (a random id when needed and not given); schemes that
        read them from the body ignore them.
        """
        raise NotImplementedError

    def _mac(self, secret: str, content: bytes) -> bytes:
        return _hmac(self.signing_key(secret), content, self.algorithm)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class StandardWebhooks(Scheme):
    """Standard Webhooks (https://www.standardwebhooks.com/), which Svix also sends as
    ``svix-*`` headers. Signed content ``{id}.{timestamp}.{body}``, HMAC-SHA256 keyed
    with the base64-decoded secret after ``whsec_``, base64 ``v1,<sig>`` entries separated
    by spaces (other versions ignored).

    Meta: ``event_id`` = the id header (a missing one is ``malformed_signature`` already,
    as it is part of the signed content); ``event_type`` = body ``type``; ``occurred_at`` =
    body ``timestamp`` (ISO 8601) else the timestamp header; ``entity_id`` = body
    ``data.id`` when present (the spec's envelope puts the object under ``data``).
    """

    name = "standard"

    def signing_key(self, secret: str) -> bytes:
        encoded = secret.removeprefix("whsec_")
        # Padding is optional in stored secrets (the reference library appends "==").
        key = _decode_base64_lenient(encoded)
        if not key:
            raise ValueError("a Standard Webhooks secret is base64 after 'whsec_'")
        return key

    @staticmethod
    def _prefix(headers: Mapping[str, str]) -> str:
        return (
            "svix"
            if "webhook-signature" not in headers and "svix-signature" in headers
            else "webhook"
        )

    def _offered(self, request: Request) -> tuple[list[bytes], str | None, bytes]:
        p = self._prefix(request.headers)
        header = _signature_header(request, f"{p}-signature")
        timestamp = _timestamp(request.headers.get(f"{p}-timestamp"))
        msg_id = request.headers.get(f"{p}-id", "").strip()
        if not msg_id:
            raise VerificationFailed("malformed_signature")
        candidates = []
        for entry in header.split():
            version, _, signature = entry.partition(",")
            if version == "v1" and (mac := _decode_base64(signature)) and len(mac) == 32:
                candidates.append(mac)
        if not candidates:
            raise VerificationFailed("malformed_signature")
        return candidates, timestamp, _text(f"{msg_id}.{timestamp}.") + request.body

    def extract(self, request: Request, parsed: Any) -> EventMeta:
        p = self._prefix(request.headers)
        body = parsed if isinstance(parsed, dict) else {}
        return EventMeta(
            event_id=_event_id(request.headers.get(f"{p}-id", "").strip()),
            event_type=_str(body.get("type")),
            occurred_at=_from_iso(body.get("timestamp"))
            or _from_unix(request.headers.get(f"{p}-timestamp", "").strip()),
            entity_id=_str(_dig(body, "data.id")),
        )

    def sign(
        self,
        *,
        body: bytes,
        secret: str,
        timestamp: int | None = None,
        event_id: str = "",
        event_type: str = "",
    ) -> dict[str, str]:
        ts = _now(timestamp)
        msg_id = event_id or f"msg_{uuid.uuid4().hex}"
        mac = self._mac(secret, f"{msg_id}.{ts}.".encode() + body)
        return {
            "content-type": _JSON,
            "webhook-id": msg_id,
            "webhook-timestamp": str(ts),
            "webhook-signature": "v1," + _encode(mac, "base64"),
        }


def _decode_base64_lenient(value: str) -> bytes | None:
    """Base64 with optional padding, for stored secrets (not for signatures)."""
    try:
        return base64.b64decode(value + "=" * (-len(value) % 4), validate=True)
    except ValueError:
        return None


class Stripe(Scheme):
    """Stripe: ``Stripe-Signature: t=<unix>,v1=<hex>[,v1=<hex>…]`` over ``{t}.{body}``,
    keyed with the whole ``whsec_…`` string as UTF-8 (not decoded); ``v0`` and unknown
    entries are ignored. stripe-python only refuses old timestamps; we refuse both ways.

    Meta: ``event_id`` = body ``id`` (``evt_…``); ``event_type`` = body ``type``;
    ``occurred_at`` = body ``created``; ``entity_id`` = body ``data.object.id``.
    """

    name = "stripe"

    def _offered(self, request: Request) -> tuple[list[bytes], str | None, bytes]:
        header = _signature_header(request, "stripe-signature")
        timestamps, candidates = [], []
        for item in header.split(","):
            key, _, value = item.strip().partition("=")
            if key == "t":
                timestamps.append(value)
            elif key == "v1" and (mac := _decode_hex(value)) and len(mac) == 32:
                candidates.append(mac)
        if not timestamps:
            raise VerificationFailed("missing_timestamp")
        if len(timestamps) > 1:
            raise VerificationFailed("malformed_signature")
        timestamp = _timestamp(timestamps[0])
        if not candidates:
            raise VerificationFailed("malformed_signature")
        return candidates, timestamp, f"{timestamp}.".encode() + request.body

    def extract(self, request: Request, parsed: Any) -> EventMeta:
        body = parsed if isinstance(parsed, dict) else {}
        return EventMeta(
            event_id=_event_id(body.get("id")),
            event_type=_str(body.get("type")),
            occurred_at=_from_unix(body.get("created")),
            entity_id=_str(_dig(body, "data.object.id")),
        )

    def sign(
        self,
        *,
        body: bytes,
        secret: str,
        timestamp: int | None = None,
        event_id: str = "",
        event_type: str = "",
    ) -> dict[str, str]:
        ts = _now(timestamp)
        mac = self._mac(secret, f"{ts}.".encode() + body)
        return {"content-type": _JSON, "stripe-signature": f"t={ts},v1={mac.hex()}"}


class GitHub(Scheme):
    """GitHub: ``X-Hub-Signature-256: sha256=<hex>`` over the raw body; no timestamp, so
    no replay window. The delivery id is not signed: dedupe is on the id (a redelivery
    keeps it) and on the body's hash.

    Meta: ``event_id`` = ``X-GitHub-Delivery``; ``event_type`` = ``X-GitHub-Event``, plus
    ``.<action>`` when the body has one (``issues.opened``); ``occurred_at`` = None (the
    payloads' times differ per event type); ``entity_id`` = ``repository.full_name``: a
    coarse lock, but events about one repository then apply in order.
    """

    name = "github"
    signs_event_id = False

    def _offered(self, request: Request) -> tuple[list[bytes], str | None, bytes]:
        header = _signature_header(request, "x-hub-signature-256")
        mac = _decode_hex(header.removeprefix("sha256=")) if header.startswith("sha256=") else None
        if mac is None or len(mac) != 32:
            raise VerificationFailed("malformed_signature")
        return [mac], None, request.body

    def extract(self, request: Request, parsed: Any) -> EventMeta:
        body = parsed if isinstance(parsed, dict) else {}
        event = request.headers.get("x-github-event", "").strip()
        action = body.get("action")
        if event and isinstance(action, str) and action:
            event = f"{event}.{action}"
        return EventMeta(
            event_id=_event_id(request.headers.get("x-github-delivery", "").strip()),
            event_type=event,
            occurred_at=None,
            entity_id=_str(_dig(body, "repository.full_name")),
        )

    def sign(
        self,
        *,
        body: bytes,
        secret: str,
        timestamp: int | None = None,
        event_id: str = "",
        event_type: str = "",
    ) -> dict[str, str]:
        return {
            "content-type": _JSON,
            "x-github-delivery": event_id or str(uuid.uuid4()),
            "x-github-event": event_type or "ping",
            "x-hub-signature-256": "sha256=" + self._mac(secret, body).hex(),
        }


class Shopify(Scheme):
    """Shopify: ``X-Shopify-Hmac-SHA256: <base64>`` over the raw body; no timestamp.
    Shopify can take up to an hour to switch to a rotated secret, so keep both. The
    webhook id is not signed: dedupe is on the id and on the body's hash.

    Meta: ``event_id`` = ``X-Shopify-Webhook-Id``; ``event_type`` = ``X-Shopify-Topic``;
    ``occurred_at`` = ``X-Shopify-Triggered-At``; ``entity_id`` = body ``id`` (the order,
    product… the topic is about).
    """

    name = "shopify"
    signs_event_id = False

    def _offered(self, request: Request) -> tuple[list[bytes], str | None, bytes]:
        mac = _decode_base64(_signature_header(request, "x-shopify-hmac-sha256"))
        if mac is None or len(mac) != 32:
            raise VerificationFailed("malformed_signature")
        return [mac], None, request.body

    def extract(self, request: Request, parsed: Any) -> EventMeta:
        body = parsed if isinstance(parsed, dict) else {}
        return EventMeta(
            event_id=_event_id(request.headers.get("x-shopify-webhook-id", "").strip()),
            event_type=request.headers.get("x-shopify-topic", "").strip(),
            occurred_at=_from_iso(request.headers.get("x-shopify-triggered-at", "").strip()),
            entity_id=_str(body.get("id")),
        )

    def sign(
        self,
        *,
        body: bytes,
        secret: str,
        timestamp: int | None = None,
        event_id: str = "",
        event_type: str = "",
    ) -> dict[str, str]:
        return {
            "content-type": _JSON,
            "x-shopify-webhook-id": event_id or str(uuid.uuid4()),
            "x-shopify-topic": event_type or "orders/create",
            "x-shopify-hmac-sha256": _encode(self._mac(secret, body), "base64"),
        }


class Slack(Scheme):
    """Slack: ``X-Slack-Signature: v0=<hex>`` over ``v0:{ts}:{body}`` with
    ``X-Slack-Request-Timestamp``. Bodies are JSON (Events API) or form-encoded (slash
    commands; interactivity sends one ``payload`` field holding JSON).

    Meta, JSON: ``event_id`` = ``event_id``; ``event_type`` = ``event.type`` else ``type``;
    ``occurred_at`` = ``event_time``. Form: ``event_id`` = ``trigger_id`` (of the
    ``payload`` for interactivity); ``event_type`` = the ``command`` field's value
    (``/deploy``), or the payload's ``type`` (``block_actions``); ``occurred_at`` = None.
    ``entity_id`` = "" (Slack events do not update one entity in place).
    A ``url_verification`` body has no ``event_id``: the view answers its challenge itself.
    """

    name = "slack"
    content_types = (_FORM, _JSON)

    def _offered(self, request: Request) -> tuple[list[bytes], str | None, bytes]:
        header = _signature_header(request, "x-slack-signature")
        timestamp = _timestamp(request.headers.get("x-slack-request-timestamp"))
        mac = _decode_hex(header.removeprefix("v0=")) if header.startswith("v0=") else None
        if mac is None or len(mac) != 32:
            raise VerificationFailed("malformed_signature")
        return [mac], timestamp, f"v0:{timestamp}:".encode() + request.body

    def parse(self, request: Request) -> Any:
        if not _is_form(request):
            return _parse_json(request.body)
        form = _parse_form(request.body)
        if "payload" in form:
            return {**form, "payload": _parse_json(form["payload"].encode())}
        return form

    def extract(self, request: Request, parsed: Any) -> EventMeta:
        body = parsed if isinstance(parsed, dict) else {}
        if _is_form(request):
            payload = body.get("payload")
            if isinstance(payload, dict):
                event_id, event_type = payload.get("trigger_id"), _str(payload.get("type"))
            else:
                event_id, event_type = body.get("trigger_id"), _str(body.get("command"))
            return EventMeta(_event_id(event_id), event_type, None, "")
        return EventMeta(
            event_id=_event_id(body.get("event_id")),
            event_type=_str(_dig(body, "event.type")) or _str(body.get("type")),
            occurred_at=_from_unix(body.get("event_time")),
            entity_id="",
        )

    def sign(
        self,
        *,
        body: bytes,
        secret: str,
        timestamp: int | None = None,
        event_id: str = "",
        event_type: str = "",
    ) -> dict[str, str]:
        ts = _now(timestamp)
        mac = self._mac(secret, f"v0:{ts}:".encode() + body)
        return {
            "content-type": _JSON if body.lstrip().startswith(b"{") else _FORM,
            "x-slack-request-timestamp": str(ts),
            "x-slack-signature": f"v0={mac.hex()}",
        }


class GenericHmac(Scheme):
    """A configurable HMAC scheme for providers without their own class.

    Options (all strings; header names are matched lower-cased):

    - ``header`` (``x-signature``), ``prefix`` (``""``, e.g. ``sha256=``),
      ``algorithm`` (``sha256``, ``sha1``, ``sha512``), ``encoding`` (``hex``, ``base64``);
    - ``timestamp_header``: when set, the request is timestamped (replay window applies)
      and the signed content is ``{timestamp}.{body}`` unless ``signed_template`` says
      otherwise, e.g. ``{timestamp}:{body}``; the template holds ``{body}`` once and may
      use ``{timestamp}`` (needs ``timestamp_header``) and ``{id}`` (needs ``id_header``);
    - ``id_header``, else ``id_field`` (dotted JSON path, ``id``): the event id;
    - ``type_header``, else ``type_field`` (``type``): the event type;
    - ``entity_field`` (dotted JSON path, none): the entity id.

    ``occurred_at`` is None: a generic sender's body time has no agreed field.
    """

    name = "hmac"
    OPTIONS: ClassVar[frozenset[str]] = frozenset(
        {
            "header",
            "algorithm",
            "encoding",
            "prefix",
            "timestamp_header",
            "signed_template",
            "id_header",
            "id_field",
            "type_header",
            "type_field",
            "entity_field",
        }
    )
    ALGORITHMS: ClassVar[tuple[str, ...]] = ("sha256", "sha1", "sha512")
    ENCODINGS: ClassVar[tuple[str, ...]] = ("hex", "base64")

    def __init__(self, **options: Any) -> None:
        unknown = set(options) - self.OPTIONS
        if unknown:
            raise ValueError(f"unknown hmac scheme options {sorted(unknown)}")
        for key, value in options.items():
            if value is not None and not isinstance(value, str):
                raise ValueError(f"hmac scheme option {key!r} must be a string")
        o = {k: v for k, v in options.items() if v is not None}
        self.header = o.get("header", "x-signature").lower()
        self.algorithm = o.get("algorithm", "sha256").lower()
        self.encoding = o.get("encoding", "hex").lower()
        self.prefix = o.get("prefix", "")
        self.timestamp_header = o.get("timestamp_header", "").lower()
        self.id_header = o.get("id_header", "").lower()
        self.id_field = o.get("id_field", "id")
        self.type_header = o.get("type_header", "").lower()
        self.type_field = o.get("type_field", "type")
        self.entity_field = o.get("entity_field", "")
        default_template = "{timestamp}.{body}" if self.timestamp_header else "{body}"
        self.signed_template = o.get("signed_template", default_template)
        if not self.header:
            raise ValueError("the hmac scheme needs a signature header")
        if self.prefix and not _PREFIX.fullmatch(self.prefix):
            # A header value arrives stripped of surrounding whitespace, in printable
            # ASCII: a prefix outside that could be signed but never verified.
            raise ValueError(
                f"hmac scheme option 'prefix': {self.prefix!r} must be printable ASCII "
                "and not start with a space"
            )
        named = {
            "header": self.header,
            "timestamp_header": self.timestamp_header,
            "id_header": self.id_header,
            "type_header": self.type_header,
        }
        named = {option: name for option, name in named.items() if name}
        for option, name in named.items():
            if not _HEADER_NAME.fullmatch(name):
                raise ValueError(f"hmac scheme option {option!r}: {name!r} is not a header name")
        if len(set(named.values())) != len(named):
            # One header cannot carry two things: signing would overwrite one with the other.
            raise ValueError(f"hmac scheme header options must name different headers: {named}")
        if self.algorithm not in self.ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.algorithm!r}; use one of {self.ALGORITHMS}")
        if self.encoding not in self.ENCODINGS:
            raise ValueError(f"unknown encoding {self.encoding!r}; use one of {self.ENCODINGS}")
        self._template = self._split_template(self.signed_template)
        # An id from the body is signed with it; one from a header only if the template
        # puts it in the signed content.
        self.signs_event_id = not self.id_header or "{id}" in self.signed_template
        self._digest_size = hashlib.new(self.algorithm).digest_size

    def _split_template(self, template: str) -> tuple[str, str]:
        try:
            parts = [p for p in string.Formatter().parse(template) if p[1] is not None]
        except ValueError as exc:
            raise ValueError(f"bad signed_template {template!r}: {exc}") from None
        fields = [field for _, field, spec, conversion in parts if not spec and not conversion]
        allowed = {"body", "timestamp"} if self.timestamp_header else {"body"}
        if self.id_header:
            allowed.add("id")
        if (
            len(fields) != len(parts)
            or fields.count("body") != 1
            or template.count("{body}") != 1
            or not set(fields) <= allowed
        ):
            raise ValueError(
                f"signed_template {template!r} must hold {{body}} once and only "
                f"{sorted(allowed - {'body'})} besides"
            )
        before, after = template.split("{body}")
        return before, after

    def _content(self, body: bytes, timestamp: str, msg_id: str) -> bytes:
        def fill(part: str) -> bytes:
            # str.replace, not format(): values must not be read as format specs.
            filled = part.replace("{timestamp}", timestamp).replace("{id}", msg_id)
            return _text(filled.replace("{{", "{").replace("}}", "}"))

        before, after = self._template
        return fill(before) + body + fill(after)

    def _offered(self, request: Request) -> tuple[list[bytes], str | None, bytes]:
        header = _signature_header(request, self.header)
        timestamp = None
        if self.timestamp_header:
            timestamp = _timestamp(request.headers.get(self.timestamp_header))
        msg_id = ""
        if self.id_header:
            msg_id = request.headers.get(self.id_header, "").strip()
            if not msg_id and "{id}" in self.signed_template:
                raise VerificationFailed("malformed_signature")
        if not header.startswith(self.prefix):
            raise VerificationFailed("malformed_signature")
        value = header[len(self.prefix) :].strip()
        mac = _decode_hex(value) if self.encoding == "hex" else _decode_base64(value)
        if mac is None or len(mac) != self._digest_size:
            raise VerificationFailed("malformed_signature")
        return [mac], timestamp, self._content(request.body, timestamp or "", msg_id)

    def extract(self, request: Request, parsed: Any) -> EventMeta:
        if self.id_header:
            event_id = request.headers.get(self.id_header, "").strip()
        else:
            event_id = _dig(parsed, self.id_field)
        if self.type_header:
            event_type = request.headers.get(self.type_header, "").strip()
        else:
            event_type = _str(_dig(parsed, self.type_field))
        entity = _str(_dig(parsed, self.entity_field)) if self.entity_field else ""
        return EventMeta(_event_id(event_id), event_type, None, entity)

    def sign(
        self,
        *,
        body: bytes,
        secret: str,
        timestamp: int | None = None,
        event_id: str = "",
        event_type: str = "",
    ) -> dict[str, str]:
        ts = str(_now(timestamp)) if self.timestamp_header else ""
        msg_id = event_id or (str(uuid.uuid4()) if self.id_header else "")
        mac = self._mac(secret, self._content(body, ts, msg_id))
        headers = {"content-type": _JSON, self.header: self.prefix + _encode(mac, self.encoding)}
        if self.timestamp_header:
            headers[self.timestamp_header] = ts
        if self.id_header:
            headers[self.id_header] = msg_id
        if self.type_header and event_type:
            headers[self.type_header] = event_type
        return headers


class Polled(Scheme):
    """A source fed by polling (``ingest/changes.py``), not by webhooks: nothing posted to
    its webhook URL is ever authentic, and the stored records are parsed as JSON."""

    name = "poll"

    def verify(
        self, request: Request, *, secrets: Sequence[str], now: float, tolerance: int = 300
    ) -> None:
        raise VerificationFailed("no_secret")

    def extract(self, request: Request, parsed: Any) -> EventMeta:
        raise UnparseableBody("polled sources are not posted to")

    def sign(self, **kwargs: Any) -> dict[str, str]:
        raise NotImplementedError("polled sources are not posted to")


# --- Mail sources -----------------------------------------------------------------------

_MULTIPART = "multipart/form-data"


@dataclass(frozen=True)
class MailPost:
    """A message as a mail source hands it over: the raw RFC 5322 bytes and its
    envelope (the recipients the message is delivered to, the envelope sender), with any
    verdicts the provider gave outside the message (SendGrid's ``SPF`` and ``dkim``
    fields)."""

    raw: bytes
    recipients: tuple[str, ...]
    mail_from: str
    verdicts: Mapping[str, str] = field(default_factory=dict)


class EmailScheme(Scheme):
    """A mail source: the SMTP listener's (``smtp``) or a provider's inbound parse
    (``mailgun``, ``postmark``, ``sendgrid``). Every one hands over the raw message
    (``mail``); the receive path inspects and stores it as inbound emails
    (``ingest.receiving.email_receive``). Options, all optional:

    - ``addresses``: what mail is accepted for: ``support@example.com`` (with its plus
      forms), ``@example.com`` (a whole domain), shell patterns
      (``*@inbound.example.com``). The SMTP listener refuses other recipients at RCPT
      and takes nothing without them; for a provider, empty means whatever its routes
      post, and a post for none of them is stored rejected (``no_accepted_recipient``).
    - ``separator`` (``+``): the plus-address separator; ``support+ticket-123@…`` is
      about the entity ``ticket-123``.
    - ``entity_header`` and ``entity_pattern``: where the entity comes from when the
      recipient has no tag: the first group of a regular expression searched in a header
      (``Subject`` and ``\\[#(\\d+)\\]``).
    - ``authserv_id``: whose ``Authentication-Results`` header holds the provider's
      verdicts (default: the topmost, the one the receiving provider wrote).
    - ``allow_ips``: the networks (CIDRs) a provider posts from; empty: any.
    - ``allow_http``: take basic-auth posts over plain HTTP (default: HTTPS only).
    """

    is_email = True
    content_types = (_FORM, _MULTIPART)
    # A message with attachments, base64-encoded (4/3) inside a form post.
    default_max_body_bytes = 25 * 1024 * 1024
    OPTIONS: ClassVar[frozenset[str]] = frozenset(
        {
            "addresses",
            "separator",
            "entity_header",
            "entity_pattern",
            "authserv_id",
            "allow_ips",
            "allow_http",
        }
    )

    def __init__(self, **options: Any) -> None:
        unknown = set(options) - self.OPTIONS
        if unknown:
            raise ValueError(f"unknown {self.name} scheme options {sorted(unknown)}")
        addresses = options.get("addresses") or []
        if not isinstance(addresses, list | tuple) or not all(
            isinstance(a, str) and a.strip() and "@" in a for a in addresses
        ):
            raise ValueError("option 'addresses' is a list of addresses, '@domain's or patterns")
        self.addresses = tuple(a.strip().lower() for a in addresses)
        self.separator = options.get("separator", "+")
        if not isinstance(self.separator, str) or len(self.separator) > 1:
            raise ValueError("option 'separator' is one character (or '' for none)")
        self.entity_header = options.get("entity_header", "")
        pattern = options.get("entity_pattern", "")
        if not isinstance(self.entity_header, str) or not isinstance(pattern, str):
            raise ValueError("options 'entity_header' and 'entity_pattern' are strings")
        if bool(self.entity_header) != bool(pattern):
            raise ValueError("options 'entity_header' and 'entity_pattern' go together")
        try:
            self.entity_pattern = re.compile(pattern) if pattern else None
        except re.error as exc:
            raise ValueError(f"option 'entity_pattern': {exc}") from None
        self.authserv_id = options.get("authserv_id", "")
        if not isinstance(self.authserv_id, str):
            raise ValueError("option 'authserv_id' is a string")
        allow_ips = options.get("allow_ips") or []
        if not isinstance(allow_ips, list | tuple):
            raise ValueError("option 'allow_ips' is a list of CIDRs")
        try:
            self.allow_ips = tuple(ipaddress.ip_network(n, strict=False) for n in allow_ips)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"option 'allow_ips': {exc}") from None
        self.allow_http = options.get("allow_http", False)
        if not isinstance(self.allow_http, bool):
            raise ValueError("option 'allow_http' is true or false")

    def verify(
        self, request: Request, *, secrets: Sequence[str], now: float, tolerance: int = 300
    ) -> None:
        if self.allow_ips and not address_in(request.remote, self.allow_ips):
            raise VerificationFailed("ip_not_allowed")
        self._authenticate(request, secrets=secrets, now=now, tolerance=tolerance)

    def _authenticate(
        self, request: Request, *, secrets: Sequence[str], now: float, tolerance: int
    ) -> None:
        super().verify(request, secrets=secrets, now=now, tolerance=tolerance)

    def parse(self, request: Request) -> Any:
        """A stored message (its body is the raw message) as the ``email`` package reads it."""
        from .mail import parse

        return parse(request.body)

    def extract(self, request: Request, parsed: Any) -> EventMeta:
        raise UnparseableBody("mail sources are stored as inbound emails")

    def mail(self, request: Request) -> MailPost:
        """The message a verified post carries; UnparseableBody if there is none."""
        raise NotImplementedError

    def replay_key(self, request: Request) -> str:
        """What makes a verified post unique when its signature does not cover the
        message (Mailgun's token): the receive path refuses a second post with it. ""
        when the scheme has none."""
        return ""

    def post(
        self,
        *,
        raw: bytes,
        recipients: Sequence[str],
        mail_from: str,
        secret: str,
        timestamp: int | None = None,
    ) -> tuple[bytes, dict[str, str]]:
        """(body, lower-cased headers) of the post the provider would send for ``raw``."""
        raise NotImplementedError

    def sign(self, **kwargs: Any) -> dict[str, str]:
        raise NotImplementedError("a mail provider's post is built by post()")


def address_in(remote: str, networks: Sequence[Any]) -> bool:
    """Whether ``remote`` (an address as text; an IPv4-mapped IPv6 one as its IPv4) is in
    one of ``networks``; False for text that is no address."""
    try:
        address = ipaddress.ip_address(remote)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    return any(address in network for network in networks)


def _form_fields(request: Request) -> dict[str, bytes]:
    """A form post's fields (the first value of each) as bytes: url-encoded, or
    multipart/form-data read with the ``email`` package (no temporary files: the body
    is already in memory, within the source's limit)."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != _MULTIPART:
        return {k: v.encode() for k, v in _parse_form(request.body).items()}
    envelope = BytesParser(policy=email_policy.HTTP).parsebytes(
        b"Content-Type: " + _text(content_type) + b"\r\n\r\n" + request.body
    )
    if not envelope.is_multipart() or envelope.defects:
        raise UnparseableBody("invalid_form")
    fields: dict[str, bytes] = {}
    for part in envelope.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str) and name not in fields:
            fields[name] = part.get_payload(decode=True) or b""
    return fields


def _multipart(fields: Sequence[tuple[str, bytes]]) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    chunks = []
    for name, value in fields:
        chunks.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
            + value
            + b"\r\n"
        )
    return b"".join(chunks) + f"--{boundary}--\r\n".encode(), f"{_MULTIPART}; boundary={boundary}"


class Smtp(EmailScheme):
    """The SMTP listener's source (``manage.py run_smtp``). Nothing posted to its webhook
    URL is authentic. Its secrets, if any, are ``user:password`` pairs the listener's
    AUTH accepts (AUTH is then required); ``max_body_bytes`` is the message-size limit."""

    name = "smtp"
    default_max_body_bytes = 10 * 1024 * 1024

    def verify(
        self, request: Request, *, secrets: Sequence[str], now: float, tolerance: int = 300
    ) -> None:
        raise VerificationFailed("no_secret")

    def signing_key(self, secret: str) -> bytes:
        return _credentials(secret)


def _credentials(secret: str) -> bytes:
    if ":" not in secret:
        raise ValueError("a credential is 'user:password'")
    return secret.encode()


class _BasicAuth(EmailScheme):
    """Postmark's and SendGrid's inbound posts carry no signature: the URL holds a
    user and password (``https://user:password@host/ingest/<slug>/``), which arrive as
    ``Authorization: Basic``. Each secret is one ``user:password``; the comparison is
    constant-time against every live one. Over plain HTTP the password would travel in
    clear, so such posts are refused (``insecure_transport``) unless ``allow_http``."""

    def signing_key(self, secret: str) -> bytes:
        return _credentials(secret)

    def _authenticate(
        self, request: Request, *, secrets: Sequence[str], now: float, tolerance: int
    ) -> None:
        keys = self._keys(secrets)
        if not request.secure and not self.allow_http:
            raise VerificationFailed("insecure_transport")
        kind, _, value = _signature_header(request, "authorization").partition(" ")
        offered = _decode_base64(value.strip()) if kind.lower() == "basic" else None
        if not offered:
            raise VerificationFailed("malformed_signature")
        if not _any_match([offered], keys):
            raise VerificationFailed("bad_signature")

    @staticmethod
    def _authorization(secret: str) -> str:
        return "Basic " + base64.b64encode(secret.encode()).decode()


class Mailgun(EmailScheme):
    """Mailgun's routes, ``forward()`` to a URL ending in ``mime`` (its raw-MIME post):
    form fields ``timestamp``, ``token``, ``signature`` (hex HMAC-SHA256 of
    ``{timestamp}{token}`` keyed with the webhook signing key), ``body-mime`` (the
    message), ``recipient`` and ``sender`` (the envelope). The signature covers the
    timestamp and token, not the message; the replay window (``replay_tolerance``)
    applies both ways and the message is deduplicated on its Message-ID.
    Mailgun posts the signature inside the form, so the form is read before the
    signature is checked; the message is not parsed until it has been."""

    name = "mailgun"

    def _offered(self, request: Request) -> tuple[list[bytes], str | None, bytes]:
        try:
            fields = _form_fields(request)
        except UnparseableBody:
            raise VerificationFailed("malformed_signature") from None
        signature = fields.get("signature", b"").decode("ascii", "replace").strip()
        if not signature:
            raise VerificationFailed("missing_signature")
        timestamp = _timestamp(fields.get("timestamp", b"").decode("ascii", "replace"))
        token = fields.get("token", b"")
        mac = _decode_hex(signature)
        if mac is None or len(mac) != 32 or not token:
            raise VerificationFailed("malformed_signature")
        return [mac], timestamp, timestamp.encode() + token

    def replay_key(self, request: Request) -> str:
        return _form_fields(request).get("token", b"").decode("ascii", "replace")

    def mail(self, request: Request) -> MailPost:
        fields = _form_fields(request)
        raw = fields.get("body-mime")
        if not raw:
            raise UnparseableBody("no_raw_message")
        recipients = fields.get("recipient", b"").decode("utf-8", "replace")
        return MailPost(
            raw=raw,
            recipients=tuple(r.strip() for r in recipients.split(",") if r.strip()),
            mail_from=fields.get("sender", b"").decode("utf-8", "replace").strip(),
        )

    def post(self, *, raw, recipients, mail_from, secret, timestamp=None):
        ts = str(_now(timestamp))
        token = uuid.uuid4().hex + uuid.uuid4().hex[:18]  # 50 characters, as Mailgun's
        signature = self._mac(secret, (ts + token).encode()).hex()
        body, content_type = _multipart(
            [
                ("timestamp", ts.encode()),
                ("token", token.encode()),
                ("signature", signature.encode()),
                ("recipient", ", ".join(recipients).encode()),
                ("sender", mail_from.encode()),
                ("body-mime", raw),
            ]
        )
        return body, {"content-type": content_type}


class Postmark(_BasicAuth):
    """Postmark's inbound webhook, with "Include raw email content" on: JSON whose
    ``RawEmail`` is the message and ``OriginalRecipient`` the address it was sent to
    (else the ``ToFull``, ``CcFull`` and ``BccFull`` addresses); the envelope sender is
    not posted, so it is the ``From`` address. Basic auth; Postmark publishes the
    addresses it posts from, for ``allow_ips``."""

    name = "postmark"
    content_types = (_JSON,)

    def mail(self, request: Request) -> MailPost:
        body = _parse_json(request.body)
        if not isinstance(body, dict):
            raise UnparseableBody("invalid_json")
        raw = body.get("RawEmail")
        if not isinstance(raw, str) or not raw:
            raise UnparseableBody("no_raw_message")
        recipients = []
        if isinstance(body.get("OriginalRecipient"), str) and body["OriginalRecipient"]:
            recipients.append(body["OriginalRecipient"])
        else:
            for key in ("ToFull", "CcFull", "BccFull"):
                for entry in body.get(key) or ():
                    if isinstance(entry, dict) and isinstance(entry.get("Email"), str):
                        recipients.append(entry["Email"])
        return MailPost(
            raw=_text_bytes(raw),
            recipients=tuple(r.strip() for r in recipients if r.strip()),
            mail_from=_str(body.get("From")).strip(),
        )

    def post(self, *, raw, recipients, mail_from, secret, timestamp=None):
        body = {
            "From": mail_from,
            "OriginalRecipient": recipients[0] if recipients else "",
            "ToFull": [{"Email": r, "Name": ""} for r in recipients],
            "MessageID": str(uuid.uuid4()),
            "RawEmail": raw.decode("utf-8", "surrogateescape"),
        }
        return json.dumps(body).encode(), {
            "content-type": _JSON,
            "authorization": self._authorization(secret),
        }


class SendGrid(_BasicAuth):
    """SendGrid's Inbound Parse, with "POST the raw, full MIME message" on:
    multipart/form-data whose ``email`` field is the message and ``envelope`` a JSON
    ``{"to": [...], "from": ...}``; its ``SPF`` and ``dkim`` fields are SendGrid's
    verdicts, recorded beside any ``Authentication-Results``. Basic auth."""

    name = "sendgrid"
    content_types = (_MULTIPART,)

    def mail(self, request: Request) -> MailPost:
        fields = _form_fields(request)
        raw = fields.get("email")
        if not raw:
            raise UnparseableBody("no_raw_message")
        envelope = _parse_json(fields.get("envelope") or b"{}")
        envelope = envelope if isinstance(envelope, dict) else {}
        to = envelope.get("to") or []
        to = [to] if isinstance(to, str) else to
        verdicts = {}
        spf = fields.get("SPF", b"").decode("utf-8", "replace").strip().lower()
        if spf:
            verdicts["spf"] = spf[:40]
        dkim = re.search(r":\s*([a-z]+)", fields.get("dkim", b"").decode("utf-8", "replace"))
        if dkim:
            verdicts["dkim"] = dkim.group(1)
        if verdicts:
            verdicts["by"] = "sendgrid"
        return MailPost(
            raw=raw,
            recipients=tuple(r.strip() for r in to if isinstance(r, str) and r.strip()),
            mail_from=_str(envelope.get("from")).strip(),
            verdicts=verdicts,
        )

    def post(self, *, raw, recipients, mail_from, secret, timestamp=None):
        body, content_type = _multipart(
            [
                ("envelope", json.dumps({"to": list(recipients), "from": mail_from}).encode()),
                ("SPF", b"pass"),
                ("dkim", b"{@example.org : pass}"),
                ("email", raw),
            ]
        )
        return body, {"content-type": content_type, "authorization": self._authorization(secret)}


def _text_bytes(value: str) -> bytes:
    return value.encode("utf-8", "surrogateescape")


SCHEMES: dict[str, type[Scheme]] = {
    cls.name: cls
    for cls in (
        StandardWebhooks,
        Stripe,
        GitHub,
        Shopify,
        Slack,
        GenericHmac,
        Polled,
        Smtp,
        Mailgun,
        Postmark,
        SendGrid,
    )
}
# The schemes a source can be created with (``create_source``): webhooks and mail.
WEBHOOK_SCHEMES = tuple(name for name in SCHEMES if name != Polled.name)
EMAIL_SCHEMES = tuple(name for name, cls in SCHEMES.items() if cls.is_email)


def get_scheme(name: str, options: Mapping[str, Any] | None = None) -> Scheme:
    """The scheme called ``name``, configured with ``options`` (only ``hmac`` takes any);
    ValueError for an unknown name or bad options."""
    try:
        cls = SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown signature scheme {name!r}; known: {sorted(SCHEMES)}") from None
    return cls(**dict(options or {}))
