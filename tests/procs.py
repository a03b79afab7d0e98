"""Process helpers for tests and chaos harnesses (Linux /proc; no Django)."""

from pathlib import Path


def children(pid: int) -> set[int]:
    """The pids whose parent is ``pid``."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.add(int(entry.name))
    return found
