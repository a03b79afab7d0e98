"""The alerts framework: conditions as data.

A *check* is a function ``check(now) -> list[Signal]``; the apps register theirs from
``AppConfig.ready`` (``register_check``), and each pass of the alerts runs every check
and records what it signals as an incident (``deliveries.alerts``: one incident per
(kind, key), one message per incident). A ``Signal``'s ``severity`` is ``warning`` or
``critical``.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime


@dataclass(frozen=True)
class Signal:
    kind: str
    key: str
    summary: str
    severity: str = "warning"
    details: dict = field(default_factory=dict)


Check = Callable[[datetime], list[Signal]]
CHECKS: dict[str, Check] = {}


def register_check(name: str, check: Check) -> None:
    CHECKS[name] = check
