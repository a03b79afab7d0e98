from django.contrib import admin
from django.urls import include, path

from ingest import views as ingest_views

from . import health, metrics

urlpatterns = [
    path("admin/", admin.site.urls),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", metrics.metrics_view, name="metrics"),
    path("api/", include("deliveries.api_urls")),
    # ingest's customer routes under the same /api/v1/ (deliveries never imports ingest).
    path("api/v1/", include("ingest.api_urls")),
    path("ingest/<slug:slug>/", ingest_views.receive, name="ingest-receive"),
]
