"""Every admin page answers input the database cannot take with 400, never 500.

The admin checks most of what it parses, but not all, and PostgreSQL refuses more than
Python: a NUL character in any text, a time-zone offset past ±15:59 (Python takes up to
±23:59). Such a value in a list filter, a search, an object id or a form reached the
database and raised ``DataError``, and an action's selection that is no primary key
(``garbage`` for a UUID) raised ``ValidationError``: a 500 each. This middleware, for
every view of every admin site (each app's pages, third-party ones and the custom views
alike), refuses before the view runs a request carrying NUL anywhere or an action
selection that is no primary key of the model, and answers a ``DataError`` the view
raises (a value the database refused) with the same 400."""

import logging

from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.core.exceptions import ValidationError
from django.db import DataError
from django.http import HttpResponseBadRequest

logger = logging.getLogger("deliveries.admin")


class AdminInputMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_view(self, request, view_func, view_args, view_kwargs):
        if not _is_admin(request):
            return None
        if _carries_nul(request):
            return _refused(request, "nul")
        # A ModelAdmin's views carry their admin (ModelAdmin.get_urls); the site's don't.
        model_admin = getattr(view_func, "model_admin", None)
        if model_admin is not None and not _selection_is_keys(request, model_admin.model):
            return _refused(request, "selection_not_keys")
        return None

    def process_exception(self, request, exception):
        if _is_admin(request) and isinstance(exception, DataError):
            return _refused(request, "database_refused_value")
        return None


def _is_admin(request) -> bool:
    match = request.resolver_match
    return match is not None and "admin" in match.app_names


def _carries_nul(request) -> bool:
    params = [request.GET]
    if request.method == "POST":
        params.append(request.POST)
    texts = [request.path]
    for query in params:
        for key, values in query.lists():
            texts.append(key)
            texts.extend(values)
    return any("\x00" in text for text in texts)


def _selection_is_keys(request, model) -> bool:
    if request.method != "POST":
        return True
    try:
        for value in request.POST.getlist(ACTION_CHECKBOX_NAME):
            model._meta.pk.to_python(value)
    except ValidationError:
        return False
    return True


def _refused(request, reason: str) -> HttpResponseBadRequest:
    # The path only: the query string is the hostile part, and may carry anything.
    logger.warning(
        "admin request refused",
        extra={"action": "admin.input_refused", "reason": reason, "path": request.path},
    )
    return HttpResponseBadRequest(
        "<h1>Bad request (400)</h1><p>A value in this request cannot be stored or searched "
        "for: a NUL character, a time-zone offset past ±15:59, or a selected row that is "
        "no id.</p>"
    )
