"""bench/peak_rss.py: a command's peak RSS is its own, however large the process that
asks is (the growth and backfill-memory benchmarks read it)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import peak_rss

ROOT = Path(__file__).resolve().parents[2]

MIB = 1024 * 1024


def allocate(mib: int) -> str:
    """A Python command that touches ``mib`` MiB, prints a line and exits 3."""
    return (
        f"b = bytearray({mib} * {MIB}); b[::4096] = b'1' * len(b[::4096]); "
        "print('allocated'); raise SystemExit(3)"
    )


@pytest.fixture
def large_parent():
    """This process made larger than any child here: 400 MiB touched."""
    ballast = bytearray(400 * MIB)
    ballast[::4096] = b"1" * len(ballast[::4096])
    yield
    del ballast


def test_a_child_of_a_large_process_is_charged_its_own_peak(large_parent):
    code, peak_mib, out, _ = peak_rss.run(
        [sys.executable, "-c", allocate(120)], stdout=subprocess.PIPE, text=True
    )
    assert code == 3
    assert out == "allocated\n"
    assert 120 <= peak_mib < 200, peak_mib


def test_the_same_child_started_directly_is_charged_the_parent(large_parent):
    """Why the module exists: wait4 on a direct child reports this process's 400 MiB."""
    child = subprocess.Popen([sys.executable, "-c", allocate(120)], stdout=subprocess.DEVNULL)
    _, _, usage = os.wait4(child.pid, 0)
    assert usage.ru_maxrss / 1024 >= 400


def test_a_larger_child_measures_larger():
    _, small, _, _ = peak_rss.run([sys.executable, "-c", allocate(20)])
    _, large, _, _ = peak_rss.run([sys.executable, "-c", allocate(220)])
    assert small < 100 and large >= 220
    assert large - small >= 180


def test_without_a_command_it_prints_its_usage(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "peak_rss.py"), str(tmp_path / "out.json")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "usage" in done.stderr


def test_a_command_that_cannot_start_has_no_measurement(tmp_path):
    with pytest.raises(RuntimeError, match="no measurement"):
        peak_rss.run([str(tmp_path / "missing")], stderr=subprocess.DEVNULL)
