import fcntl
from pathlib import Path

import pytest

from tests.e2e.host_wheel import WheelVenv, build_wheel_venv


@pytest.fixture(scope="session")
def wheel_venv(tmp_path_factory, worker_id) -> WheelVenv:
    """The wheel and a fresh virtualenv with it, built once for every host test. Under
    pytest-xdist the workers share one build: the first to take the lock builds it in
    the run's common temporary directory, the others wait and reuse it."""
    if worker_id == "master":
        return build_wheel_venv(tmp_path_factory.mktemp("wheel"))
    shared = tmp_path_factory.getbasetemp().parent / "wheel"
    shared.mkdir(exist_ok=True)
    with (shared / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        built = shared / "built"
        if built.exists():
            python, wheel = built.read_text().splitlines()
            return WheelVenv(wheel=Path(wheel), python=Path(python))
        venv = build_wheel_venv(shared)
        built.write_text(f"{venv.python}\n{venv.wheel}\n")
        return venv
