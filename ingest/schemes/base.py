"""The interface every scheme stands behind, and the primitives the schemes of this
package share (MACs, timestamps, encodings, the body's fields). Pure: no database, no
settings, no clock."""

from __future__ import annotations

import base64
import hmac
import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
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
