from rest_framework.routers import SimpleRouter

from .api import BackfillRunViewSet

router = SimpleRouter(trailing_slash="/?")
router.register("backfill-runs", BackfillRunViewSet, basename="backfill-run")

urlpatterns = router.urls
