"""What the tests of a host project installed from the wheel share: the wheel built from a
copy of this checkout and a fresh virtualenv holding it and its declared dependencies
(built once a session: tests/e2e/conftest.py), a run helper, and a receiver that checks
every signature with the ``standardwebhooks`` library."""

import os
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from standardwebhooks.webhooks import Webhook

ROOT = Path(__file__).resolve().parents[2]
# What a source tree holds that is no source: a copy without them builds as a clean clone.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", "var",
    ".pytest_cache", ".ruff_cache", ".hypothesis", "test-output", "node_modules",
)  # fmt: skip
TIMEOUT = 180


def run(args: list, **kwargs) -> subprocess.CompletedProcess:
    """Run to completion (killed at the timeout); fail with its output on a non-zero exit."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT, **kwargs)
    except subprocess.TimeoutExpired as exc:
        out, err = (o.decode() if isinstance(o, bytes) else o for o in (exc.stdout, exc.stderr))
        pytest.fail(f"{args} timed out:\n{out}\n--- stderr\n{err}")
    assert done.returncode == 0, (
        f"{args} exited {done.returncode}:\n{done.stdout}\n--- stderr\n{done.stderr}"
    )
    return done


@dataclass(frozen=True)
class WheelVenv:
    wheel: Path
    python: Path  # the fresh virtualenv's

    @property
    def bin(self) -> Path:
        return self.python.parent

    def environ(self, **extra: str) -> dict[str, str]:
        """This process's environment without what would point into this checkout or the
        suite's database, with the virtualenv first on PATH."""
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in {"DATABASE_URL", "DJANGO_SETTINGS_MODULE", "PYTHONPATH", "VIRTUAL_ENV"}
        }
        env.update(PYTHONUNBUFFERED="1", PATH=f"{self.bin}{os.pathsep}{env['PATH']}", **extra)
        return env


def build_wheel_venv(tmp: Path) -> WheelVenv:
    # 1. The wheel, built as the README says (python -m build, in its isolated build
    # environment) from a copy of the checkout, so no build/ or *.egg-info lands in it
    # and no stale build/ leaks in.
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", tmp / "dist", source],
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    (wheel,) = (tmp / "dist").glob("trusty_webhooks-*.whl")

    # 2. A fresh virtualenv with the wheel and its declared dependencies, nothing else.
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", venv])
    python = venv / "bin" / "python"
    run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", wheel],
        cwd=tmp,
    )
    return WheelVenv(wheel=wheel, python=python)


@dataclass(frozen=True)
class Received:
    headers: dict[str, str]
    body: bytes
    refused: str  # why standardwebhooks refused the signature; "" when it verified


class Receiver:
    """An ``http.server`` on 127.0.0.1 in a thread: every POST verified with the
    endpoint's secret (set once the endpoint exists) and recorded."""

    def __init__(self) -> None:
        self.secret = ""
        self.received: list[Received] = []
        self.arrived = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                headers = {k.lower(): v for k, v in self.headers.items()}
                try:
                    Webhook(receiver.secret).verify(body, headers)
                    refused = ""
                except Exception as exc:
                    refused = repr(exc)
                receiver.received.append(Received(headers, body, refused))
                receiver.arrived.set()
                self.send_response(400 if refused else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks/invoices"

    def __enter__(self) -> "Receiver":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@dataclass(frozen=True)
class Fence:
    """A fenced code block of a Markdown page: its language, its text as written, and the
    line it starts on (for messages)."""

    lang: str
    code: str
    line: int

    @property
    def first_line(self) -> str:
        return self.code.splitlines()[0] if self.code else ""


def fences(page: Path, *, section: str | None = None) -> list[Fence]:
    """The code blocks of ``page`` (of its ``## section`` only, when named), in order."""
    text = page.read_text()
    offset = 0
    if section is not None:
        start = text.index(f"\n## {section}\n")
        end = text.find("\n## ", start + 1)
        offset = text[:start].count("\n") + 1
        text = text[start : end if end != -1 else len(text)]
    found = []
    for match in re.finditer(r"^```(\w*)\n(.*?)^```$", text, flags=re.M | re.S):
        line = offset + text[: match.start()].count("\n") + 1
        found.append(Fence(lang=match.group(1), code=match.group(2), line=line))
    return found


def install_settings_block() -> str:
    """docs/install.md's one settings block: what a project adds to its settings.py."""
    (block,) = [
        f
        for f in fences(ROOT / "docs" / "install.md", section="Settings")
        if f.lang == "python" and f.first_line.startswith("# settings.py")
    ]
    return block.code
