"""A source fed by polling, never posted to."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import EventMeta, Request, Scheme, UnparseableBody, VerificationFailed


class Polled(Scheme):
    """A source fed by polling (``ingest/changes.py``), not by webhooks: nothing posted to
    its webhook URL is ever authentic, and the stored records are parsed as JSON."""

    name = "poll"

    def verify(
        self, request: Request, *, secrets: Sequence[str], now: float, tolerance: int = 300
    ) -> None:
        raise VerificationFailed("no_secret")

    def extract(self, request: Request, parsed: Any) -> EventMeta:
        raise UnparseableBody("polled sources are not posted to")

    def sign(self, **kwargs: Any) -> dict[str, str]:
        raise NotImplementedError("polled sources are not posted to")
