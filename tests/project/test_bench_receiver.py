"""bench/receiver.py, the receiver every benchmark posts to: its failure and retry paths."""

import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import subprocess_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench_receiver():
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "receiver.py"), "--port", "0"],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(proc.stdout.readline().split()[1])
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def post(url: str, webhook_id: str) -> int:
    request = urllib.request.Request(  # noqa: S310 - a local receiver
        url, data=b"{}", method="POST", headers={"webhook-id": webhook_id}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_the_flaky_path_fails_the_first_copy_of_each_delivery_only(bench_receiver):
    assert post(f"{bench_receiver}/flaky/hook", "a") == 503
    assert post(f"{bench_receiver}/flaky/hook", "a") == 200
    assert post(f"{bench_receiver}/flaky/hook", "b") == 503
    assert post(f"{bench_receiver}/hook", "c") == 200


def test_the_status_path_answers_that_status_every_time(bench_receiver):
    assert post(f"{bench_receiver}/status/503/hook", "a") == 503
    assert post(f"{bench_receiver}/status/503/hook", "a") == 503
    assert post(f"{bench_receiver}/status/410/hook", "b") == 410
