"""The baseline of ``bench/ingest.py``: a trivial Django view, served like the real one.

Same settings module (``project.settings``: installed apps, middleware, logging), same
gunicorn configuration (``project/gunicorn.conf.py``), same URL; only ``ROOT_URLCONF``
points here, to one view that reads the body and answers ``{"ok": true}`` without
touching the database. What the receive view costs beyond this is what verifying,
deduplicating and storing an event costs.

    gunicorn -c project/gunicorn.conf.py bench.ingest_trivial:application
"""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

from django.conf import settings
from django.core.wsgi import get_wsgi_application
from django.http import JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST


@csrf_exempt
@require_POST
def trivial(request, slug: str):
    request.read()  # the receive view reads the body too
    return JsonResponse({"ok": True})


urlpatterns = [path("ingest/<slug:slug>/", trivial)]

# Only the URLconf differs from the project's; everything else is project.settings.
settings.ROOT_URLCONF = __name__
application = get_wsgi_application()
