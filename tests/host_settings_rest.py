"""A host whose own REST_FRAMEWORK disagrees with the product's API on everything: basic
auth and IsAuthenticated, page numbers of one, a per-user throttle of one a day, a JSON
parser that takes anything, an error handler of its own and DRF's own schema class.
tests/project/test_host.py shows the product's API unchanged by it, and the host's views
keeping it."""

from tests.host_settings import *  # noqa: F403

ROOT_URLCONF = "tests.host_urls_rest"
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework.authentication.BasicAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.PageNumberPagination",
    "PAGE_SIZE": 1,
    "DEFAULT_THROTTLE_CLASSES": ["rest_framework.throttling.UserRateThrottle"],
    "DEFAULT_THROTTLE_RATES": {"user": "1/day"},
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_SCHEMA_CLASS": "rest_framework.schemas.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "tests.host_urls_rest.host_errors",
}
