"""A command's own peak resident set size, measured from a small process of its own.

Linux charges a child the memory of the process that started it: ``exec`` records the
high-water mark of the address space it replaces (the starting process's copy, or with
``vfork`` that process's own) in the child's ``ru_maxrss``. So ``os.wait4`` on a child
of a large process (a harness with Django loaded and its results in memory) reports
whichever is larger, that process or the child, and two runs of a command can compare
the harness with itself. (The harness's 10,000 against 1,000,000 due rows measured
153.3 MiB at both sizes that way, the size of the harness itself; the scheduler's own
peak is about 93 MiB.)

Here the command is a child of this small interpreter instead: it starts from this
process's few MiB, so its ``ru_maxrss`` is its own peak, with this process's resident
set (about 10 MiB, below any Django process) as the floor.

    python bench/peak_rss.py OUT.json -- command [args...]

runs the command with this process's stdin, stdout and stderr, writes
``{"peak_rss_kib": ...}`` to OUT.json, and exits with the command's exit code (128 + the
signal's number when a signal ended it). A SIGTERM or SIGINT sent here is passed on.
:func:`run` does all of that from Python.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python bench/peak_rss.py OUT.json -- command [args...]", file=sys.stderr)
        return 2
    out, command = Path(argv[0]), argv[2:]
    child = subprocess.Popen(command)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda s, _frame: child.send_signal(s))
    _, status, usage = os.wait4(child.pid, 0)  # retried after a signal (PEP 475)
    out.write_text(json.dumps({"peak_rss_kib": usage.ru_maxrss}))  # KiB on Linux
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def run(
    command: list[str], **popen_kwargs
) -> tuple[int, float, str | bytes | None, str | bytes | None]:
    """Run ``command`` to its end through this module: (its exit code, its peak RSS in
    MiB, and what it wrote to any pipe asked for in ``popen_kwargs``, else None)."""
    fd, name = tempfile.mkstemp(prefix="peak-rss-", suffix=".json")
    os.close(fd)
    try:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), name, "--", *command],
            **popen_kwargs,
        )
        stdout, stderr = proc.communicate()
        text = Path(name).read_text()
    finally:
        Path(name).unlink(missing_ok=True)
    if not text:
        raise RuntimeError(f"peak_rss: no measurement of {command[:3]} (exit {proc.returncode})")
    return proc.returncode, json.loads(text)["peak_rss_kib"] / 1024, stdout, stderr


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
