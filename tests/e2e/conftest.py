import pytest

from tests.e2e.host_wheel import WheelVenv, build_wheel_venv


@pytest.fixture(scope="session")
def wheel_venv(tmp_path_factory) -> WheelVenv:
    """The wheel and a fresh virtualenv with it, built once for every host test."""
    return build_wheel_venv(tmp_path_factory.mktemp("wheel"))
