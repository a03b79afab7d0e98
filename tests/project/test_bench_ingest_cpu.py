"""bench/ingest_cpu.py: the load generator's requests, pushed through the WSGI application
as gunicorn serves it, are accepted and stored, one statement each."""

import pytest
from django.core.signals import request_finished, request_started
from django.db import close_old_connections

from bench import ingest_cpu
from ingest.models import InboundEvent
from ingest.sources import source_create

pytestmark = pytest.mark.django_db


@pytest.fixture
def application():
    source_create(slug=ingest_cpu.SLUG, scheme="stripe", secrets=[ingest_cpu.SECRET])
    # As Django's test client does: the test's transaction keeps its connection.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield ingest_cpu.application_for("ingest")
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


def test_each_request_is_accepted_and_stored_with_one_statement(application):
    ingest_cpu.serve(application, ingest_cpu.environs(1, 2))  # the source is cached
    stop = ingest_cpu.count_statements()
    answers = ingest_cpu.serve(application, ingest_cpu.environs(3, 5))
    statements = stop()

    assert [status for status, _ in answers] == ["200 OK"] * 5
    ingest_cpu.check("ingest", answers, stored=7)
    assert InboundEvent.objects.count() == 7
    assert statements == 5


def test_a_refused_answer_fails_the_run(application):
    environ = ingest_cpu.environs(1, 1)[0]
    environ["HTTP_STRIPE_SIGNATURE"] = "t=1,v1=00"

    answers = ingest_cpu.serve(application, [environ])

    assert answers[0][0].startswith("401")
    with pytest.raises(SystemExit):
        ingest_cpu.check("ingest", answers, stored=0)
