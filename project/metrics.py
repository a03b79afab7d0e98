"""Prometheus metrics. Counters live in each process's default registry; under gunicorn
with several workers, set PROMETHEUS_MULTIPROC_DIR so prometheus-client aggregates them
(the /metrics view then reads that directory)."""

import hmac
import os

from django.conf import settings
from django.http import HttpResponse, HttpResponseForbidden
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    generate_latest,
    multiprocess,
)

INBOUND_REFUSED = Counter(
    "webhooks_inbound_refused_total",
    "Inbound requests refused, by source and reason (signature failures, size, type).",
    ["source", "reason"],
)
INBOUND_RECEIVED = Counter(
    "webhooks_inbound_received_total",
    "Authentic inbound requests stored, by source and whether they were duplicates.",
    ["source", "duplicate"],
)
ATTEMPTS = Counter("webhooks_attempts_total", "Outbound delivery attempts by outcome.", ["outcome"])


def metrics_view(request):
    """``/metrics``: allowed for a Bearer METRICS_TOKEN, or from METRICS_ALLOW_IPS."""
    token = settings.METRICS_TOKEN
    offered = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    allowed = (token and hmac.compare_digest(offered.encode(), token.encode())) or (
        request.META.get("REMOTE_ADDR") in settings.METRICS_ALLOW_IPS
    )
    if not allowed:
        return HttpResponseForbidden("forbidden\n", content_type="text/plain")
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        output = generate_latest(registry)
    else:
        output = generate_latest()
    return HttpResponse(output, content_type=CONTENT_TYPE_LATEST)
