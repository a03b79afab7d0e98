"""The customer API's routes: ``router``, which deliveries.urls mounts at ``/api/v1/``
with the other apps' routes under one API root, and ``urlpatterns``, its OpenAPI schema
and docs page, mounted at ``/api/``."""

from django.urls import path
from rest_framework.routers import SimpleRouter

from .base import SchemaDocsView, SchemaView
from .views import (
    DeliveryViewSet,
    EndpointViewSet,
    EventTypeViewSet,
    EventViewSet,
    JobViewSet,
    PortalLinkViewSet,
)

router = SimpleRouter(trailing_slash="/?")
router.register("endpoints", EndpointViewSet, basename="endpoint")
router.register("events", EventViewSet, basename="event")
router.register("deliveries", DeliveryViewSet, basename="delivery")
router.register("jobs", JobViewSet, basename="job")
router.register("event-types", EventTypeViewSet, basename="event-type")
router.register("portal-link", PortalLinkViewSet, basename="portal-link")

urlpatterns = [
    path("schema/", SchemaView.as_view(), name="schema"),
    path("docs/", SchemaDocsView.as_view(url_name="schema"), name="api-docs"),
]
