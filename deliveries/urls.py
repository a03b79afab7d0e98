"""Everything a host mounts, in one line: ``path("", include("deliveries.urls"))``.

The customer API (every installed product app's routes under one ``api/v1/`` and one API
root), its OpenAPI schema and docs page, each app's own routes (the inbound receiver),
and the health and metrics views. An app takes part by naming, on its AppConfig,
``api_router`` (a dotted path to a DRF router) and ``urls_module``; so deliveries never
imports ingest, and the host's admin stays the host's.
"""

from django.apps import apps
from django.urls import include, path, re_path
from django.utils.module_loading import import_string

from . import health
from .api.base import ApiRouter
from .api.errors import api_not_found
from .core import prometheus


def _api_v1() -> ApiRouter:
    router = ApiRouter(trailing_slash="/?")
    for config in apps.get_app_configs():
        if dotted := getattr(config, "api_router", None):
            router.registry.extend(import_string(dotted).registry)
    return router


def _app_routes() -> list:
    return [
        path("", include(config.urls_module))
        for config in apps.get_app_configs()
        if getattr(config, "urls_module", None)
    ]


urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", prometheus.metrics_view, name="metrics"),
    path("api/v1/", include(_api_v1().urls)),
    path("api/", include("deliveries.api.urls")),
    # Anything else under api/ is the API's JSON 404, not the host's HTML page.
    re_path(r"^api/", api_not_found),
    # The customer portal (deliveries/portal/): a tenant's own pages, opened by a link.
    path("portal/", include("deliveries.portal.urls")),
    *_app_routes(),
]
