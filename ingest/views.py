"""``POST /ingest/<source-slug>/``: verify, dedupe, store, acknowledge. No handler runs
inside the request; the worker processes the stored event later.

Order of checks, each with its status: method (405), source known and enabled (404),
rate limit (429 with Retry-After), a header holding NUL (400: the event keeps its
headers, and PostgreSQL cannot store NUL), content type and content encoding (415:
providers sign the bytes they send and none compresses them), body size while reading
(413, without buffering past the limit; chunked bodies too), a body that stops arriving
(408: the server's read timeout fired, or the client went away mid-body) or a malformed
chunked body (400), signature over the raw bytes (401, generic body), then parse (400,
stored as rejected since it was authentic: also when its id, type or entity holds text
the database refuses), then one short transaction that inserts the event or counts a
duplicate (200 either way).

A mail source's post (Mailgun, Postmark, SendGrid) takes the same checks up to the
signature, then ``receiving.email_post_receive``: the message it carries is checked and
stored per recipient (200 with ``accepted``, ``duplicate`` or ``rejected``), a post
without one is a 400, a sender's or recipient's flood a 429. Mailgun posts raw messages
only to a URL ending in ``mime``, so ``/ingest/<slug>/mime`` is this view too.
"""

import logging

from django.http import JsonResponse, UnreadablePostError
from django.http.request import HttpHeaders
from django.views.decorators.csrf import csrf_exempt

from deliveries.core.text import text_problem

from . import receiving, sources
from .schemes import Request

logger = logging.getLogger("ingest")

READ_CHUNK = 64 * 1024
IDENTITY_ENCODINGS = frozenset({"", "identity"})
UNPREFIXED_HEADERS = HttpHeaders.UNPREFIXED_HEADERS  # CONTENT_TYPE, CONTENT_LENGTH


def _error(status: int, code: str, message: str, headers: dict | None = None) -> JsonResponse:
    response = JsonResponse({"error": {"code": code, "message": message}}, status=status)
    for name, value in (headers or {}).items():
        response[name] = value
    return response


class BadFraming(Exception):
    """The server could not decode the chunked body (bad chunk size, missing CRLF…)."""


def _read_limited(request, limit: int) -> bytes | None:
    """The body, or None once more than ``limit`` bytes arrived (reading stops there).

    Raises UnreadablePostError when the body stops arriving: the client hung up, or the
    server's read timeout fired (``GUNICORN_READ_TIMEOUT`` in project/gunicorn.conf.py);
    BadFraming when a chunked body is malformed.
    """
    declared = request.META.get("CONTENT_LENGTH")
    if declared and declared.isdigit() and int(declared) > limit:
        return None
    stream = request
    if not declared and request.META.get("wsgi.input_terminated"):
        # A chunked body has no Content-Length, and Django then reads it as empty (it caps
        # the stream at 0 bytes). A server that ends wsgi.input at the body's end (gunicorn
        # does) lets us read it ourselves, under the same limit.
        stream = _ChunkedInput(request.META["wsgi.input"])
    chunks, size = [], 0
    while True:
        chunk = stream.read(READ_CHUNK)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)


class _ChunkedInput:
    """The server's own input stream, with its failures in the view's terms."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def read(self, size: int) -> bytes:
        try:
            return self._stream.read(size)
        except OSError as exc:  # timed out, or the client went away
            raise UnreadablePostError(*exc.args) from exc
        except Exception as exc:
            # The server's chunk decoder refused the framing; its exception types are
            # its own (gunicorn's ParseException), so anything else raised here is that.
            raise BadFraming(str(exc)) from exc


@csrf_exempt
def receive(request, slug: str):
    if request.method != "POST":
        response = _error(405, "method_not_allowed", "Use POST.")
        response["Allow"] = "POST"
        return response
    source = sources.source_for(slug)
    if source is None:
        return _error(404, "not_found", "No such source.")
    wait = sources.source_throttle(source)
    if wait:
        return _error(429, "throttled", "Too many requests.", {"Retry-After": str(wait)})
    headers = _headers(request.META)
    if _unstorable_header(headers):
        sources.count_refusal(source, "bad_header", request)
        return _error(400, "bad_header", "A header holds a NUL byte.")
    content_type = request.content_type.lower()
    if content_type not in source.accepted_content_types:
        sources.count_refusal(source, "content_type", request)
        return _error(415, "unsupported_media_type", "Unsupported content type.")
    if headers.get("content-encoding", "").strip().lower() not in IDENTITY_ENCODINGS:
        sources.count_refusal(source, "content_encoding", request)
        return _error(415, "unsupported_media_type", "Unsupported content encoding.")
    try:
        body = _read_limited(request, source.max_body_bytes)
    except UnreadablePostError:
        sources.count_refusal(source, "incomplete_body", request)
        return _error(408, "request_timeout", "The body did not arrive in time.")
    except BadFraming:
        sources.count_refusal(source, "bad_framing", request)
        return _error(400, "bad_framing", "The chunked body is malformed.")
    if body is None:
        sources.count_refusal(source, "too_large", request)
        return _error(413, "too_large", "The body is too large.")
    inbound = Request(
        headers=headers,
        body=body,
        remote=sources.remote_address(request),
        secure=request.is_secure(),
    )
    if source.verifier.is_email:
        return _mail_answer(receiving.email_post_receive(source=source, request=inbound))
    outcome = receiving.inbound_receive(source=source, request=inbound, remote=inbound.remote)
    if outcome.status == 401:
        # Generic on purpose: the reason is counted, not told to the caller.
        return _error(401, "unauthorized", "Signature verification failed.")
    if outcome.status == 400:
        return _error(400, "unparseable", "The body could not be parsed.")
    return JsonResponse(
        {"status": "duplicate" if outcome.duplicate else "accepted", "id": str(outcome.event_id)}
    )


def _mail_answer(outcome: receiving.MailPostReceived) -> JsonResponse:
    if outcome.status == 401:
        return _error(401, "unauthorized", "Signature verification failed.")
    if outcome.status == 400:
        return _error(400, "unparseable", "The post holds no raw message.")
    if outcome.status == 429:
        return _error(429, "throttled", "Too many messages.", {"Retry-After": "60"})
    received = outcome.mail
    body = {"status": received.outcome, "ids": [str(i) for i in received.event_ids]}
    if received.reason:
        body["reason"] = received.reason
    # 200 for a rejected message too: it is stored, and the provider retrying it cannot
    # change what it holds.
    return JsonResponse(body)


def _headers(meta: dict) -> dict[str, str]:
    """The request's headers, names lower-cased: ``request.headers`` as a plain dict, read
    from the WSGI environ in one pass. The checks, verification and the stored event all
    use it; Django's mapping costs several times as much to build and to read."""
    headers = {}
    for key, value in meta.items():
        if key.startswith("HTTP_"):
            key = key[5:]
        elif key not in UNPREFIXED_HEADERS:
            continue
        headers[key.replace("_", "-").lower()] = value
    return headers


def _unstorable_header(headers: dict[str, str]) -> bool:
    """A header name or value the stored event could not keep (``deliveries.core.text``).
    gunicorn refuses NUL in headers before the application runs; other servers may not.
    One check of all of them joined: NUL and a lone surrogate are one character each, so
    the joined text holds one exactly when some name or value does."""
    return text_problem("".join(headers) + "".join(headers.values())) is not None
