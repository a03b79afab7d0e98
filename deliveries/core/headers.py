"""The rule for an endpoint's custom headers, in one place.

The API serializer, the model field (so the admin's form and ``full_clean``), the
services and the worker at send time all call into this module. A custom header must be

* valid HTTP: the name an RFC 9110 token (at most 256 characters), the value visible
  ASCII, spaces and tabs only (no CR, LF, NUL or other control character; at most 1000
  characters), no name twice in any spelling, at most 20 headers;
* not one the HTTP client owns: the framing headers (``Content-Length``,
  ``Transfer-Encoding``, ``Host``), the hop-by-hop ones (``Connection``, ``Keep-Alive``,
  ``TE``, ``Trailer``, ``Upgrade``, ``Expect``, every ``Proxy-*``): sent by a tenant
  they would contradict the request the client frames (``Transfer-Encoding: chunked``
  beside a ``Content-Length``, the smuggling pattern) or speak to a proxy on the way;
* not one the protocol sets (``PROTOCOL_HEADERS``: the signature and the ids).

At send time the worker sends only the headers this rule lets through
(:func:`sendable_headers`) and records the names of the others on the attempt: a row
written before the rule existed is delivered without them, and the tenant sees why.

Where the attempt log keeps a name without its value, the value is a marker:
``REDACTED`` for a custom header's (it may be a credential), ``DROPPED`` for a header the
rule kept back (not sent), ``NOT_STORED`` for the signature, which is not logged
(``deliveries.selectors.attempt_request_headers`` reads the log back).
"""

import re
from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ValidationError

MAX_HEADERS = 20

# The attempt log's stand-ins for values it does not keep.
REDACTED = "[redacted]"
DROPPED = "[dropped]"
NOT_STORED = "[not stored]"
MAX_NAME_LENGTH = 256
MAX_VALUE_LENGTH = 1000

# Set by the service on every delivery; a custom header cannot replace them.
PROTOCOL_HEADERS = frozenset(
    {"content-type", "webhook-id", "webhook-timestamp", "webhook-signature", "idempotency-key"}
)
# Framing and hop-by-hop (RFC 9110 §7.6.1, RFC 9112 §6-7): the HTTP client's, not a
# tenant's. Every name starting with "proxy-" too.
CONNECTION_HEADERS = frozenset(
    {
        "content-length",
        "transfer-encoding",
        "host",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "http2-settings",
    }
)

# RFC 9110 field-name token; used with fullmatch (``$`` would let a trailing LF in).
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
# field-value: visible ASCII, space and horizontal tab.
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e]*")


def header_problem(name: Any, value: Any) -> str | None:
    """Why ``name: value`` cannot be an endpoint's custom header, or None. Never quotes
    the value: it may be a credential."""
    if not isinstance(name, str) or len(name) > MAX_NAME_LENGTH or not HEADER_NAME.fullmatch(name):
        return f"{name!r} is not a valid header name (an RFC 9110 token)"
    lowered = name.lower()
    if lowered in CONNECTION_HEADERS or lowered.startswith("proxy-"):
        return f"{name!r} is a framing or hop-by-hop header, set by the HTTP client"
    if lowered in PROTOCOL_HEADERS:
        return f"{name!r} is set by the service"
    if not isinstance(value, str):
        return f"the value of {name!r} must be text"
    if len(value) > MAX_VALUE_LENGTH:
        return f"the value of {name!r} must be at most {MAX_VALUE_LENGTH} characters"
    if not _HEADER_VALUE.fullmatch(value):
        return (
            f"the value of {name!r} is not a valid header value "
            "(visible ASCII, spaces and tabs only)"
        )
    return None


def validate_endpoint_headers(headers: Any) -> None:
    """Raise ValidationError naming every header the rule refuses (a Django validator:
    the model field, the API serializer and the services use it)."""
    if not isinstance(headers, Mapping):
        raise ValidationError("headers must be an object of names to values", code="invalid")
    problems = [p for name, value in headers.items() if (p := header_problem(name, value))]
    if len(headers) > MAX_HEADERS:
        problems.append(f"at most {MAX_HEADERS} custom headers")
    lowered = [name.lower() for name in headers if isinstance(name, str)]
    repeated = sorted({name for name in lowered if lowered.count(name) > 1})
    if repeated:
        problems.append(f"these headers are given more than once: {repeated}")
    if problems:
        raise ValidationError(problems, code="invalid_header")


def sendable_headers(headers: Mapping[str, Any]) -> tuple[dict[str, str], list[str]]:
    """The headers of a stored endpoint the rule lets through, and the names it drops."""
    kept, dropped = {}, []
    for name, value in (headers or {}).items():
        if header_problem(name, value) is None:
            kept[name] = value
        else:
            dropped.append(name)
    return kept, dropped
