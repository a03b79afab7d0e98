"""What every mail source shares: the message as posted, the listener's and the
providers' common checks."""

from __future__ import annotations

import base64
import ipaddress
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from email import policy as email_policy
from email.parser import BytesParser
from typing import Any, ClassVar

from .. import mail
from .base import (
    _FORM,
    EventMeta,
    Request,
    Scheme,
    UnparseableBody,
    VerificationFailed,
    _any_match,
    _decode_base64,
    _parse_form,
    _signature_header,
    _text,
)

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
        return mail.parse(request.body)

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


def _text_bytes(value: str) -> bytes:
    return value.encode("utf-8", "surrogateescape")
