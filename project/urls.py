from django.contrib import admin
from django.urls import include, path
from rest_framework.routers import DefaultRouter

from deliveries.api.errors import not_found_under
from deliveries.api.urls import router as deliveries_router
from ingest import views as ingest_views
from ingest.api_urls import router as ingest_router

from . import health, metrics

# The customer API: every app's routes under one /api/v1/ and one API root that lists
# them all (deliveries never imports ingest; the project knows both).
api_v1 = DefaultRouter(trailing_slash="/?")
api_v1.registry.extend(deliveries_router.registry + ingest_router.registry)

urlpatterns = [
    path("admin/", admin.site.urls),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", metrics.metrics_view, name="metrics"),
    path("api/v1/", include(api_v1.urls)),
    path("api/", include("deliveries.api_urls")),
    path("ingest/<slug:slug>/", ingest_views.receive, name="ingest-receive"),
]

# A path under the API or the receiver that routes nowhere answers in the one error shape.
handler404 = not_found_under("/api/", "/ingest/")
