from rest_framework.routers import SimpleRouter

from .views import BackfillRunViewSet

# Mounted at /api/v1/ by deliveries.urls, beside deliveries' routes.
router = SimpleRouter(trailing_slash="/?")
router.register("backfill-runs", BackfillRunViewSet, basename="backfill-run")
