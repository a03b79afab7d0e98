"""One JSON error shape for every API error:

{"error": {"code": "not_found", "message": "…", "details": {…}}}
"""

from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404, JsonResponse, UnreadablePostError
from django.views.defaults import page_not_found
from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from ..services import DomainError


def error_body(code: str, message: str, details=None) -> dict:
    body = {"error": {"code": code, "message": message}}
    if details:
        body["error"]["details"] = details
    return body


def error_response(code: str, message: str, http_status: int, details=None, headers=None):
    return Response(error_body(code, message, details), status=http_status, headers=headers)


def not_found_under(*prefixes: str):
    """A ``handler404`` for the root URLconf: a path under ``prefixes`` that routes
    nowhere (an id holding "/", a typo) gets the one error shape, like a missing row;
    any other path gets Django's page."""

    def not_found(request, exception=None):
        if request.path_info.startswith(prefixes):
            return JsonResponse(error_body("not_found", "Not found."), status=404)
        return page_not_found(request, exception)

    return not_found


def exception_handler(exc, context):
    if isinstance(exc, DomainError):
        return error_response(exc.code, exc.message, exc.status, details=exc.details)
    if isinstance(exc, UnreadablePostError):
        # The body stopped arriving: the server's read deadline passed (project/
        # gunicorn_worker.py) or the client went away. The client's doing, not a 500.
        return error_response("request_timeout", "The body did not arrive in time.", 408)
    if isinstance(exc, Http404 | DjangoValidationError):
        exc = exceptions.NotFound()
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        return error_response(
            "invalid", "The request is not valid.", response.status_code, details=exc.detail
        )
    code = getattr(exc, "default_code", "error")
    if isinstance(exc, exceptions.APIException):
        codes = exc.get_codes()
        code = codes if isinstance(codes, str) else code
    message = response.data.get("detail", str(exc)) if isinstance(response.data, dict) else str(exc)
    headers = {
        k: v for k, v in response.items() if k in ("Retry-After", "WWW-Authenticate", "Allow")
    }
    return error_response(str(code), str(message), response.status_code, headers=headers)


# --- The errors in the OpenAPI schema ---------------------------------------------------

ERROR_SCHEMA = {
    "type": "object",
    "description": "Every error of the API has this shape.",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "additionalProperties": False,
            "properties": {
                "code": {"type": "string", "description": "Stable, machine-readable."},
                "message": {"type": "string", "description": "For a person."},
                "details": {"description": "Per field or per parameter, when there are any."},
            },
        }
    },
}

# status: (description, {example name: (code, message, details)})
ERROR_EXAMPLES = {
    400: (
        "The request is not valid: a field, a query parameter, the JSON or a cursor.",
        {
            "invalid": ("invalid", "The request is not valid.", {"url": ["Enter a valid URL."]}),
            "unknown_parameter": (
                "unknown_parameter",
                "Unknown query parameter: page_size. This route reads: cursor, format, limit.",
                {"unknown": ["page_size"], "known": ["cursor", "format", "limit"]},
            ),
            "parse_error": (
                "parse_error",
                "JSON parse error - Expecting value: line 1 column 1 (char 0)",
                None,
            ),
        },
    ),
    401: (
        "No API key, or one that is unknown, revoked or expired.",
        {"authentication_failed": ("authentication_failed", "Invalid API key.", None)},
    ),
    404: (
        "No such object for this tenant (another tenant's id answers the same).",
        {"not_found": ("not_found", "Not found.", None)},
    ),
    409: (
        "A request with this Idempotency-Key is still running.",
        {
            "idempotency_key_in_use": (
                "idempotency_key_in_use",
                "A request with this Idempotency-Key is in progress; retry later.",
                None,
            )
        },
    ),
    413: (
        "The payload is larger than the service takes.",
        {
            "payload_too_large": (
                "payload_too_large",
                "payload is 300000 bytes; the limit is 262144",
                None,
            )
        },
    ),
    415: (
        "The body is not JSON (or a form).",
        {
            "unsupported_media_type": (
                "unsupported_media_type",
                'Unsupported media type "text/plain" in request.',
                None,
            )
        },
    ),
    422: (
        "The payload does not match its type's schema, or the Idempotency-Key was used "
        "with another request.",
        {
            "payload_invalid": (
                "payload_invalid",
                "The payload does not match the schema of invoice.paid version 1: "
                "$.amount: 'many' is not of type 'integer'",
                {
                    "path": "$.amount",
                    "schema_path": "/properties/amount/type",
                    "event_type": "invoice.paid",
                    "payload_version": 1,
                },
            ),
            "idempotency_key_reused": (
                "idempotency_key_reused",
                "This Idempotency-Key was used with a different request.",
                None,
            ),
        },
    ),
    429: (
        "Too many requests for this API key; wait Retry-After seconds.",
        {
            "throttled": (
                "throttled",
                "Request was throttled. Expected available in 1 second.",
                None,
            )
        },
    ),
}


def _statuses(path: str, method: str, operation: dict) -> list[int]:
    statuses = {400}
    if operation.get("security") and operation["security"] != [{}]:
        statuses |= {401, 429}
    if any(p.get("in") == "path" for p in operation.get("parameters", [])):
        statuses.add(404)
    if "requestBody" in operation:
        statuses.add(415)
    if method == "post" and path.endswith("/events/"):
        statuses |= {409, 413, 422}
    return sorted(statuses)


def document_errors(result, generator, request, public):
    """drf-spectacular postprocessing hook: every operation lists the error answers it
    can give, each in the one error shape with realistic examples, so that a client
    generated from the schema knows them."""
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    for path, operations in result.get("paths", {}).items():
        for method, operation in operations.items():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            for status in _statuses(path, method, operation):
                description, examples = ERROR_EXAMPLES[status]
                operation["responses"].setdefault(
                    str(status),
                    {
                        "description": description,
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/Error"},
                                "examples": {
                                    name: {"value": error_body(*example)}
                                    for name, example in examples.items()
                                },
                            }
                        },
                    },
                )
    return result


def api_not_found(request, *args, **kwargs):
    """A path under the API that routes nowhere: the one error shape, whatever the host's
    ``handler404`` and ``DEBUG`` say (deliveries.urls mounts it last)."""
    return JsonResponse(error_body("not_found", "Not found."), status=404)
