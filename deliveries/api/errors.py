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
        return error_response(exc.code, exc.message, exc.status)
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
