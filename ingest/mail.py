"""Inbound email: what the receive paths and the handlers read of a message.

Pure, like ``ingest/schemes/``: no database, no settings (the limits are passed in),
no network (a DKIM lookup function is passed in). The SMTP listener, the mail providers'
inbound-parse schemes and the workers all read messages through it:

- :func:`inspect` parses a raw RFC 5322 message with the standard library's ``email``
  package and applies the rules hostile mail is refused by (malformed MIME, control
  characters in headers, too many or too large attachments, archives inside archives),
  raising :class:`Rejected` with a stable reason; otherwise it returns the
  :class:`Inspected` summary the stored row keeps (ids, addresses, subject, date,
  attachments).
- :func:`read` parses stored bytes again for a handler (:class:`Content`).
- Addresses: :func:`address_problem`, :func:`normalize`, :func:`split_plus`,
  :func:`accepts` (the configured addresses and domains), :func:`entity_for`.
- Evidence: :func:`authentication_results` (the verdicts a provider wrote) and
  :func:`dkim_verdict` (the SMTP listener's own check).
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import lzma
import re
import tarfile
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email import errors, policy
from email.header import decode_header, make_header
from email.message import EmailMessage
from email.parser import BytesParser
from email.utils import parsedate_to_datetime
from fnmatch import fnmatchcase

# Reasons a message is refused or stored as rejected (stable: counted and documented).
REASONS = frozenset(
    {
        "malformed_mime",
        "header_injection",
        "too_many_parts",
        "too_deep",
        "too_many_attachments",
        "attachment_too_large",
        "nested_archive",
        "no_accepted_recipient",
        "malformed_address",
    }
)

# Defects the parser records where the structure itself is broken: a multipart without
# its boundary, a body where headers should be, a part that claims to be multipart and
# is not. Softer defects (bad base64 padding, an undecodable header word) are ordinary in
# real mail and let through.
STRUCTURAL_DEFECTS = (
    errors.NoBoundaryInMultipartDefect,
    errors.StartBoundaryNotFoundDefect,
    errors.CloseBoundaryNotFoundDefect,
    errors.MultipartInvariantViolationDefect,
    errors.FirstHeaderLineIsContinuationDefect,
    errors.MissingHeaderBodySeparatorDefect,
)

# Headers whose decoded value is shown to staff and handed to handlers: a CR, LF or NUL
# in one (an encoded word can carry them) is an attempt to smuggle a header into
# whatever later writes that value into a message of its own.
CHECKED_HEADERS = ("from", "sender", "reply-to", "to", "cc", "subject", "message-id", "date")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# In a decoded header value a tab is ordinary; a CR, LF, NUL or other control is not.
_HEADER_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_SURROGATE = re.compile("[\ud800-\udfff]")
# RFC 5321: a path of at most 256 octets, so an address of at most 254.
MAX_ADDRESS_LENGTH = 254
_DOMAIN = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]")
_LOCAL = re.compile(r"[!#$%&'*+/=?^_`{|}~A-Za-z0-9.-]+")
# Authentication-Results (RFC 8601): "authserv-id [version]; method=result ...; ..."
_RESULT = re.compile(r"(?:^|;)\s*(spf|dkim|dmarc|arc)\s*=\s*([a-z]+)", re.IGNORECASE)
_HEADER_D = re.compile(r"header\.d\s*=\s*([^\s;]+)", re.IGNORECASE)

MAX_HEADER_BYTES = 256 * 1024
# The parser builds an object for every MIME part before the part cap can be counted on
# them: about 120 us and 400 bytes a part, so a 10 MiB message of a million empty parts
# took two minutes and 400 MB to refuse. The cap is first held on the raw bytes, on the
# lines that open or close a part of a declared boundary; and, since a boundary can be
# spelled in ways a byte pattern misses (RFC 2231 encodings, quoted pairs), on every
# line that starts with "--", which no real message has by the ten thousand.
MAX_DASHED_LINES = 10_000
_BOUNDARY_PARAM = re.compile(rb'boundary(\*[0-9]*\*?)?\s*=\s*"?([^";\r\n]*)', re.IGNORECASE)
# How far into a compressed attachment the archive check reads (it never inflates past
# this: a small bomb cannot cost more).
ARCHIVE_PEEK_BYTES = 1024 * 1024
ARCHIVE_MAX_MEMBERS = 1000
# Archive formats by their first bytes (tar's mark is at offset 257, below).
_MAGIC = (
    (b"PK\x03\x04", "zip"),
    (b"PK\x05\x06", "zip"),
    (b"\x1f\x8b", "gzip"),
    (b"BZh", "bzip2"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"7z\xbc\xaf\x27\x1c", "7z"),
    (b"Rar!\x1a\x07", "rar"),
    (b"MSCF", "cab"),
)
_ARCHIVE_SUFFIXES = (
    ".zip", ".jar", ".gz", ".tgz", ".tar", ".bz2", ".tbz", ".xz", ".txz", ".7z", ".rar",
    ".cab", ".arj", ".lz", ".lzma", ".zst", ".z", ".iso",
)  # fmt: skip


class Rejected(ValueError):
    """A message refused by a rule; ``reason`` is one of ``REASONS``."""

    def __init__(self, reason: str, detail: str = "") -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}")
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Limits:
    """The caps :func:`inspect` applies (INBOUND_EMAIL_* settings)."""

    max_parts: int = 100
    max_depth: int = 10
    max_attachments: int = 20
    max_attachment_bytes: int = 10 * 1024 * 1024


@dataclass(frozen=True)
class Attachment:
    filename: str
    content_type: str
    size: int  # decoded bytes


@dataclass(frozen=True)
class Inspected:
    """What the stored row keeps of an accepted message."""

    message_id: str  # as in the header, angle brackets stripped; "" if none
    sent_at: datetime | None  # the Date header, aware UTC
    subject: str
    from_address: str
    to: tuple[str, ...]
    cc: tuple[str, ...]
    attachments: tuple[Attachment, ...]
    authentication_results: tuple[str, ...]  # the headers, topmost first
    message: EmailMessage = field(repr=False, compare=False, default=None)


# --- Parsing -------------------------------------------------------------------------


def parse(raw: bytes) -> EmailMessage:
    """The message as the standard library reads it (``policy.default``: typed headers)."""
    return BytesParser(policy=policy.default).parsebytes(raw)


def inspect(raw: bytes, limits: Limits) -> Inspected:
    """Parse ``raw`` and apply the rules; :class:`Rejected` names the first one broken.
    Any error the parser or a header's own parser raises is ``malformed_mime``: a
    message is refused, never allowed to crash its reader."""
    try:
        return _inspect(raw, limits)
    except Rejected:
        raise
    except Exception as exc:  # the parsers' own bugs and limits included (RecursionError)
        raise Rejected("malformed_mime", type(exc).__name__) from None


def _inspect(raw: bytes, limits: Limits) -> Inspected:
    head = raw[:2048].lstrip(b"\r\n")
    if not re.match(rb"[!-9;-~]+:", head):  # a header name, then a colon
        raise Rejected("malformed_mime", "no header")
    if len(raw) > MAX_HEADER_BYTES and not re.search(rb"\r?\n\r?\n", raw[:MAX_HEADER_BYTES]):
        # Header parsing is where the email package's worst cases live: real mail's
        # header block is a few kilobytes.
        raise Rejected("malformed_mime", f"a header block over {MAX_HEADER_BYTES} bytes")
    if delimiters := _too_many_delimiters(raw, limits):
        raise Rejected("too_many_parts", f"{delimiters} delimiter lines before parsing")
    message = parse(raw)
    parts = _walk(message, limits)
    for part in parts:
        for defect in part.defects:
            if isinstance(defect, STRUCTURAL_DEFECTS):
                raise Rejected("malformed_mime", type(defect).__name__)
    _check_headers(message)
    attachments = _attachments(parts, limits)
    return Inspected(
        message_id=clean(message_id(message)),
        sent_at=sent_at(message),
        subject=clean(_header_text(message, "subject")),
        from_address=clean(_first_address(message, "from")),
        to=tuple(clean(a) for a in _addresses(message, "to")),
        cc=tuple(clean(a) for a in _addresses(message, "cc")),
        attachments=tuple(attachments),
        authentication_results=tuple(
            clean(str(v)) for v in message.get_all("authentication-results") or ()
        ),
        message=message,
    )


def _too_many_delimiters(raw: bytes, limits: Limits) -> int:
    """The delimiter lines of ``raw`` if more than ``limits.max_parts`` parts can have
    (every part but the first opens with one, every multipart closes with one), else 0.
    Counted on the bytes, before the parser builds anything; lines end in CRLF, LF or a
    lone CR, as the parser reads them."""
    ceiling = 2 * limits.max_parts

    def lines_starting(prefix: bytes) -> int:
        return raw.count(b"\n" + prefix) + raw.count(b"\r" + prefix)

    dashed = lines_starting(b"--")
    if dashed <= ceiling:
        return 0
    if dashed > MAX_DASHED_LINES:
        return dashed
    declared = _BOUNDARY_PARAM.findall(raw)
    if any(star or not value.strip() for star, value in declared):
        return dashed  # spelled beyond a byte pattern: every dashed line may be one
    # A prefix of each boundary (stripped): lines it starts count, a superset of its own.
    found = sum(lines_starting(b"--" + value) for value in {v.strip() for _, v in declared})
    return found if found > ceiling else 0


def clean(text: str) -> str:
    """``text`` as a text column takes it: a lone surrogate (undecodable bytes in a
    header) becomes U+FFFD, a control character other than tab its ``\\xNN`` escape."""
    text = _SURROGATE.sub("\ufffd", text)
    return _HEADER_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _walk(message: EmailMessage, limits: Limits) -> list[EmailMessage]:
    """Every part, message/rfc822 attachments included, iteratively (no recursion to
    exhaust), within the caps on their number and depth."""
    found: list[EmailMessage] = []
    stack: list[tuple[EmailMessage, int]] = [(message, 0)]
    while stack:
        part, depth = stack.pop()
        if depth > limits.max_depth:
            raise Rejected("too_deep", f"more than {limits.max_depth} levels")
        found.append(part)
        if len(found) > limits.max_parts:
            raise Rejected("too_many_parts", f"more than {limits.max_parts}")
        if part.is_multipart():
            payload = part.get_payload()
            children = payload if isinstance(payload, list) else [payload]
            stack.extend((child, depth + 1) for child in reversed(children))
    return found


def _check_headers(message: EmailMessage) -> None:
    # Read from the raw header lines, decoded by hand: the typed headers refuse some of
    # these values with a bare ValueError, which would hide the reason.
    for name, value in message.raw_items():
        if name.lower() in CHECKED_HEADERS and _HEADER_CONTROL.search(_decoded(value)):
            raise Rejected("header_injection", name.lower())


def _decoded(value: str) -> str:
    unfolded = re.sub(r"\r?\n(?=[ \t])", "", value)
    try:
        return str(make_header(decode_header(unfolded)))
    except (LookupError, ValueError, UnicodeError):  # an unknown charset, a broken word
        return unfolded


def _attachments(parts: list[EmailMessage], limits: Limits) -> list[Attachment]:
    found = []
    for part in parts:
        if part.is_multipart() or not _is_attachment(part):
            continue
        if len(found) >= limits.max_attachments:
            raise Rejected("too_many_attachments", f"more than {limits.max_attachments}")
        data = part.get_payload(decode=True) or b""
        if len(data) > limits.max_attachment_bytes:
            raise Rejected("attachment_too_large", f"{len(data)} bytes")
        filename = part.get_filename() or ""
        if archive_holds_archive(data, filename):
            raise Rejected("nested_archive", filename[:100])
        found.append(Attachment(clean(filename), clean(part.get_content_type()), len(data)))
    return found


def _is_attachment(part: EmailMessage) -> bool:
    if part.get_content_disposition() == "attachment" or part.get_filename():
        return True
    # An inline part that is not text (an image, an application/zip without a name).
    return part.get_content_maintype() not in ("text", "multipart", "message")


def message_id(message: EmailMessage) -> str:
    value = str(message.get("message-id", "") or "").strip()
    return value.removeprefix("<").removesuffix(">").strip()


def sent_at(message: EmailMessage) -> datetime | None:
    """The Date header as aware UTC; None if missing or unreadable."""
    value = message.get("date")
    if value is None:
        return None
    parsed = getattr(value, "datetime", None)
    if parsed is None:
        try:
            parsed = parsedate_to_datetime(str(value))
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
    if parsed is None:
        return None
    if parsed.tzinfo is None:  # "-0000": the time is UTC, its zone unknown
        parsed = parsed.replace(tzinfo=UTC)
    try:
        return parsed.astimezone(UTC)
    except (OverflowError, ValueError):
        return None


def message_key(message_id_value: str, raw: bytes) -> str:
    """What a message is deduplicated on: its Message-ID, or the SHA-256 of the raw
    bytes when it has none."""
    if message_id_value:
        return f"<{message_id_value}>"
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def _header_text(message: EmailMessage, name: str) -> str:
    value = message.get(name)
    return "" if value is None else str(value)


def _addresses(message: EmailMessage, name: str) -> list[str]:
    found = []
    for value in message.get_all(name) or ():
        found.extend(normalize(a.addr_spec) for a in getattr(value, "addresses", ()) if a.addr_spec)
    return found


def _first_address(message: EmailMessage, name: str) -> str:
    addresses = _addresses(message, name)
    return addresses[0] if addresses else ""


# --- What a handler reads --------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """An attachment as a handler gets it: its bytes too."""

    filename: str
    content_type: str
    payload: bytes


@dataclass(frozen=True)
class Content:
    message: EmailMessage
    text: str  # the first text/plain body part ("" if none)
    html: str  # the first text/html body part ("" if none)
    attachments: tuple[Part, ...] = field(default=())


def read(raw: bytes) -> Content:
    """The stored bytes parsed again: bodies and attachments for a handler. A body that
    cannot be decoded as its charset says is decoded as UTF-8 with replacement."""
    message = parse(raw)
    bodies = {}
    for kind in ("plain", "html"):
        body = message.get_body(preferencelist=(kind,))
        if body is None or body.get_content_subtype() != kind:
            bodies[kind] = ""
            continue
        try:
            bodies[kind] = body.get_content()
        except (LookupError, ValueError, UnicodeError):  # an unknown or lying charset
            bodies[kind] = (body.get_payload(decode=True) or b"").decode("utf-8", "replace")
    attachments = tuple(
        Part(p.get_filename() or "", p.get_content_type(), p.get_payload(decode=True) or b"")
        for p in message.walk()
        if not p.is_multipart() and p is not message and _is_attachment(p)
    )
    return Content(
        message=message, text=bodies["plain"], html=bodies["html"], attachments=attachments
    )


# --- Addresses ------------------------------------------------------------------------


def address_problem(address: str) -> str | None:
    """Why an envelope address cannot be taken ("header_injection" for control
    characters, "malformed_address" otherwise), or None."""
    if _CONTROL.search(address):
        return "header_injection"
    if len(address) > MAX_ADDRESS_LENGTH or not address.isascii():
        return "malformed_address"
    local, at, domain = address.rpartition("@")
    if not at or not _LOCAL.fullmatch(local) or not _DOMAIN.fullmatch(domain):
        return "malformed_address"
    return None


def normalize(address: str) -> str:
    return address.strip().lower()


def split_plus(address: str, separator: str = "+") -> tuple[str, str]:
    """(the base address, the tag): ``support+ticket-123@x`` gives
    (``support@x``, ``ticket-123``); no tag gives (address, "")."""
    local, _, domain = normalize(address).rpartition("@")
    base, sep, tag = local.partition(separator) if separator else (local, "", "")
    return (f"{base}@{domain}", tag if sep else "")


def accepts(patterns: Iterable[str], address: str, separator: str = "+") -> bool:
    """Whether ``address`` (its base, without the plus tag) is one of the configured
    addresses: ``support@example.com``, a whole domain as ``@example.com``, or a shell
    pattern (``*@inbound.example.com``)."""
    base, _ = split_plus(address, separator)
    domain = base.rpartition("@")[2]
    for pattern in patterns:
        pattern = normalize(pattern)
        if pattern.startswith("@"):
            if domain == pattern[1:]:
                return True
        elif fnmatchcase(base, pattern):
            return True
    return False


def entity_for(
    recipient: str,
    message: EmailMessage | None,
    *,
    separator: str = "+",
    header: str = "",
    pattern: re.Pattern | None = None,
) -> str:
    """The entity a message is about: the recipient's plus tag, else the first group of
    ``pattern`` in the ``header`` (``Subject``, ``In-Reply-To``…), else ""."""
    _, tag = split_plus(recipient, separator)
    if tag:
        return tag
    if header and pattern is not None and message is not None:
        value = message.get(header)
        if value is not None:
            match = pattern.search(str(value))
            if match:
                return (match.group(1) if match.groups() else match.group(0))[:300]
    return ""


# --- Archives -------------------------------------------------------------------------


def archive_kind(data: bytes, filename: str = "") -> str | None:
    """The archive format ``data`` is in (by its first bytes, else its name), or None."""
    for magic, kind in _MAGIC:
        if data.startswith(magic):
            return kind
    if len(data) > 262 and data[257:262] == b"ustar":
        return "tar"
    if filename.lower().endswith(_ARCHIVE_SUFFIXES):
        return "unknown"
    return None


def archive_holds_archive(data: bytes, filename: str = "") -> bool:
    """Whether an attachment is an archive with another archive inside (a zip in a zip,
    a zip in a tar.gz): a scanner that unpacks one level misses what is below. Read
    within bounds: member names and first bytes, ``ARCHIVE_PEEK_BYTES`` of a
    compressed stream at most."""
    kind = archive_kind(data, filename)
    if kind is None:
        return False
    try:
        return any(archive_kind(head, name) for name, head in _members(kind, data))
    except (OSError, EOFError, ValueError, zipfile.BadZipFile, tarfile.TarError, lzma.LZMAError):
        return False  # unreadable: one opaque archive, not known to hold another


def _members(kind: str, data: bytes) -> Iterable[tuple[str, bytes]]:
    if kind == "zip":
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            for info in archive.infolist()[:ARCHIVE_MAX_MEMBERS]:
                with archive.open(info) as member:
                    yield info.filename, member.read(300)
    elif kind in ("gzip", "bzip2", "xz"):
        opener = {"gzip": gzip.GzipFile, "bzip2": bz2.BZ2File, "xz": lzma.LZMAFile}[kind]
        with opener(fileobj=io.BytesIO(data)) as stream:
            inner = stream.read(ARCHIVE_PEEK_BYTES)
        if len(inner) > 262 and inner[257:262] == b"ustar":
            yield from _tar_members(inner)
        else:
            yield "", inner[:300]
    elif kind == "tar":
        yield from _tar_members(data)


def _tar_members(data: bytes) -> Iterable[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        for n, member in enumerate(archive):
            if n >= ARCHIVE_MAX_MEMBERS:
                return
            head = b""
            if member.isfile():
                extracted = archive.extractfile(member)
                head = extracted.read(300) if extracted else b""
            yield member.name, head


# --- Evidence -------------------------------------------------------------------------


def authentication_results(headers: Sequence[str], authserv_id: str = "") -> dict[str, str]:
    """The SPF, DKIM, DMARC (and ARC) verdicts of one ``Authentication-Results`` header:
    the one whose authserv-id is ``authserv_id`` when given, else the topmost (the
    receiving provider prepends its own; anything below came with the message and
    proves nothing). {} when there is none."""
    chosen = None
    for header in headers:
        server = header.split(";", 1)[0].strip().split()
        if not authserv_id or (server and server[0].lower() == authserv_id.lower()):
            chosen = header
            break
    if chosen is None:
        return {}
    verdicts = {"by": chosen.split(";", 1)[0].strip()[:200]}
    for method, result in _RESULT.findall(chosen):
        verdicts.setdefault(method.lower(), result.lower())
    domain = _HEADER_D.search(chosen)
    if domain and "dkim" in verdicts:
        verdicts["dkim_domain"] = domain.group(1).lower()[:200]
    return verdicts


def dkim_verdict(raw: bytes, dnsfunc: Callable) -> dict[str, str]:
    """The listener's own DKIM check of ``raw`` (dkimpy), with ``dnsfunc`` looking up the
    signer's key: ``pass``, ``fail``, ``none`` (no signature) or ``temperror`` (the
    lookup failed)."""
    import dkim

    if b"dkim-signature:" not in raw[: raw.find(b"\r\n\r\n") + 1 or len(raw)].lower():
        return {"dkim": "none", "by": "smtp"}
    checker = dkim.DKIM(raw)
    try:
        ok = checker.verify(dnsfunc=dnsfunc)
    except dkim.DnsTimeoutError:
        return {"dkim": "temperror", "by": "smtp"}
    except dkim.DKIMException:
        ok = False
    verdict = {"dkim": "pass" if ok else "fail", "by": "smtp"}
    if checker.domain:
        verdict["dkim_domain"] = checker.domain.decode("ascii", "replace").lower()
    return verdict
