import pytest

from ingest.sources import source_create

SECRET = "whsec_test_secret"


@pytest.fixture
def stripe():
    """The inbound source ``stripe`` (scheme stripe), signed with ``SECRET``."""
    return source_create(slug="stripe", scheme="stripe", secrets=[SECRET])
