"""A configurable HMAC scheme for providers without their own module."""

from __future__ import annotations

import hashlib
import string
import uuid
from typing import Any, ClassVar

from .base import (
    _HEADER_NAME,
    _JSON,
    _PREFIX,
    EventMeta,
    Request,
    Scheme,
    VerificationFailed,
    _decode_base64,
    _decode_hex,
    _dig,
    _encode,
    _event_id,
    _now,
    _signature_header,
    _str,
    _text,
    _timestamp,
)


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
