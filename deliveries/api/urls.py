from rest_framework.routers import SimpleRouter

from .views import DeliveryViewSet, EndpointViewSet, EventViewSet, JobViewSet

# Mounted at /api/v1/ by deliveries.urls, with the other apps' routes, under one API root.
router = SimpleRouter(trailing_slash="/?")
router.register("endpoints", EndpointViewSet, basename="endpoint")
router.register("events", EventViewSet, basename="event")
router.register("deliveries", DeliveryViewSet, basename="delivery")
router.register("jobs", JobViewSet, basename="job")
