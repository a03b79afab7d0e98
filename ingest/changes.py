"""Polling providers that have no webhooks, with a cursor over the data.

An adapter lists the records changed since a time, a page at a time, in ``(updated_at,
id)`` order. :func:`read_changes` walks those pages from a :class:`Cursor` and hands each
page's new records to a ``store`` callback, which writes them as inbound events *and* the
advanced cursor in one transaction. The cursor rules (docs/polling.md):

- it is the highest ``(updated_at, id)`` actually stored, never our clock;
- the next listing asks for ``updated_at >= cursor_at`` and skips the ids already stored at
  exactly ``cursor_at`` (``cursor_ids``): equal timestamps cause neither losses nor
  duplicates;
- a signpost, the provider's time when the run started, bounds the run: records stamped at
  or after it are left for the next run, because the provider may still be writing more
  records with those timestamps (with smaller ids, behind our page token);
- it advances only in the transaction that stores the records.

Each record becomes an inbound event whose id is ``<record id>@<updated_at as sent>``: a
re-read is a duplicate, a real change is a new event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

from yarl import URL

from deliveries.core.egress import EgressError, EgressPolicy, EgressSession
from deliveries.selectors import egress_policy_for
from ingest.conf import settings

from .receiving import NewEvent
from .schemes import MAX_EVENT_ID_LENGTH
from .schemes.base import _dig, _from_iso, _from_unix

logger = logging.getLogger("ingest")


class PollError(Exception):
    """The provider's answer cannot be used; nothing of the page was stored. ``status`` is
    the HTTP status when there was one (429 and 5xx are worth retrying)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


# --- The adapter interface ------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    id: str
    updated_at: datetime  # aware UTC
    updated_at_raw: str  # as the provider wrote it: part of the event id
    event_type: str
    body: bytes  # the record as JSON

    @property
    def event_id(self) -> str:
        return f"{self.id}@{self.updated_at_raw}"

    def as_event(self) -> NewEvent:
        return NewEvent(
            event_id=self.event_id,
            event_type=self.event_type,
            entity_id=self.id,
            occurred_at=self.updated_at,
            body=self.body,
        )


@dataclass(frozen=True)
class Page:
    records: list[Record]
    next_token: str | None  # None: the listing is exhausted
    server_time: datetime | None = None  # the provider's clock when it answered
    total: int | None = None  # records in the listing, if the provider says


class PollAdapter(ABC):
    """One kind of provider API."""

    @abstractmethod
    def list_changed(
        self, *, since: datetime | None, page_token: str | None, page_size: int
    ) -> Page:
        """One page of records with ``updated_at >= since`` in ``(updated_at, id)`` order;
        ``page_token`` continues the listing that produced it."""

    def close(self) -> None:  # noqa: B027  (optional hook)
        pass


# --- The HTTP JSON adapter --------------------------------------------------------------


class EgressFetcher:
    """Synchronous GETs through ``deliveries.core.egress`` (SSRF guard, timeouts, size cap) for
    the poller's synchronous loop: one private event loop, run between database writes."""

    def __init__(
        self, *, max_response_bytes: int, timeout: float, policy: EgressPolicy | None = None
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._session = EgressSession(policy, max_response_bytes=max_response_bytes, pool_size=4)
        self._timeout = timeout

    def get(self, url: str | URL, headers: dict[str, str]):
        return self._loop.run_until_complete(
            self._session.get(str(url), headers=headers, timeout=self._timeout)
        )

    def close(self) -> None:
        self._loop.run_until_complete(self._session.close())
        self._loop.close()


# Settings of the HTTP JSON adapter, with their defaults.
HTTP_JSON_DEFAULTS: dict[str, Any] = {
    "url": None,  # required
    "auth_header": "Authorization",  # sent with PollSource.auth_secret, if one is set
    "since_param": "updated_since",
    "since_format": "iso",  # or "unix" (seconds, with a fraction)
    "page_size": 100,
    "page_size_param": "limit",
    "page_token_param": "page_token",
    "records_path": "data",
    "next_path": "next",  # the next page's token; null or missing on the last page
    "id_path": "id",
    "updated_at_path": "updated_at",
    "event_type": "record.updated",  # or, per record:
    "type_path": "",
    "server_time_path": "",  # else the Date header is the signpost
    "total_path": "",
    "timeout": 30.0,
}


def http_json_config(config: dict[str, Any]) -> dict[str, Any]:
    """The adapter's settings with defaults filled in; ValueError names what is wrong."""
    unknown = set(config) - set(HTTP_JSON_DEFAULTS)
    if unknown:
        raise ValueError(
            f"unknown poll settings {sorted(unknown)}; known: {sorted(HTTP_JSON_DEFAULTS)}"
        )
    merged = {**HTTP_JSON_DEFAULTS, **config}
    if not isinstance(merged["url"], str) or not merged["url"].startswith(("http://", "https://")):
        raise ValueError("poll setting 'url' must be an http(s) URL")
    if merged["since_format"] not in ("iso", "unix"):
        raise ValueError("poll setting 'since_format' must be 'iso' or 'unix'")
    for key in ("since_param", "page_size_param", "page_token_param", "records_path", "id_path"):
        if not isinstance(merged[key], str) or not merged[key]:
            raise ValueError(f"poll setting {key!r} must be a non-empty string")
    if not isinstance(merged["page_size"], int) or not 1 <= merged["page_size"] <= 100_000:
        raise ValueError("poll setting 'page_size' must be an integer from 1 to 100000")
    if not isinstance(merged["timeout"], int | float) or not merged["timeout"] > 0:
        raise ValueError("poll setting 'timeout' must be a positive number of seconds")
    return merged


class HttpJsonAdapter(PollAdapter):
    """A paginated JSON API listing records changed since a time, e.g.
    ``GET /records?updated_since=…&limit=100&page_token=…`` answering
    ``{"data": [{"id": …, "updated_at": …}, …], "next": "…"}``. Every request goes
    through the egress guard."""

    def __init__(
        self,
        config: dict[str, Any],
        *,
        auth_secret: str = "",
        fetcher=None,
        policy: EgressPolicy | None = None,
    ) -> None:
        self.config = http_json_config(config)
        self._auth_secret = auth_secret
        self._fetcher = fetcher or EgressFetcher(
            max_response_bytes=settings.POLL_MAX_RESPONSE_BYTES,
            timeout=self.config["timeout"],
            policy=policy,
        )

    def close(self) -> None:
        self._fetcher.close()

    def _since(self, since: datetime) -> str:
        if self.config["since_format"] == "unix":
            return f"{since.timestamp():.6f}"
        return since.astimezone(UTC).isoformat().replace("+00:00", "Z")

    def list_changed(
        self, *, since: datetime | None, page_token: str | None, page_size: int
    ) -> Page:
        c = self.config
        query = {c["page_size_param"]: str(page_size)}
        if since is not None:
            query[c["since_param"]] = self._since(since)
        if page_token:
            query[c["page_token_param"]] = page_token
        url = URL(c["url"]).update_query(query)
        headers = {"Accept": "application/json"}
        if self._auth_secret:
            headers[c["auth_header"]] = self._auth_secret
        try:
            response = self._fetcher.get(url, headers)
        except EgressError as exc:
            raise PollError(f"request failed: {exc}") from exc
        if response.status != 200:
            raise PollError(f"the provider answered HTTP {response.status}", response.status)
        if response.truncated:
            raise PollError(
                "a page is larger than POLL_MAX_RESPONSE_BYTES "
                f"({settings.POLL_MAX_RESPONSE_BYTES}); ask for smaller pages"
            )
        try:
            body = json.loads(response.body)
        except ValueError as exc:
            raise PollError(f"the page is not JSON: {exc}") from None
        items = _dig(body, c["records_path"])
        if not isinstance(items, list):
            raise PollError(f"no list of records at {c['records_path']!r}")
        records = [self._record(item, n) for n, item in enumerate(items)]
        token = _dig(body, c["next_path"]) if c["next_path"] else None
        total = _dig(body, c["total_path"]) if c["total_path"] else None
        return Page(
            records=records,
            next_token=str(token) if token not in (None, "") else None,
            server_time=self._server_time(body, response.headers),
            total=total if isinstance(total, int) and not isinstance(total, bool) else None,
        )

    def _record(self, item: Any, n: int) -> Record:
        c = self.config
        record_id = _dig(item, c["id_path"])
        raw = _dig(item, c["updated_at_path"])
        if isinstance(record_id, bool) or not isinstance(record_id, str | int) or record_id == "":
            raise PollError(f"record {n} has no id at {c['id_path']!r}")
        updated_at = _parse_time(raw)
        if updated_at is None:
            raise PollError(f"record {n} has no usable time at {c['updated_at_path']!r}")
        event_type = _dig(item, c["type_path"]) if c["type_path"] else c["event_type"]
        record = Record(
            id=str(record_id),
            updated_at=updated_at,
            updated_at_raw=str(raw),
            event_type=event_type if isinstance(event_type, str) else c["event_type"],
            body=json.dumps(item, separators=(",", ":")).encode(),
        )
        if len(record.event_id) > MAX_EVENT_ID_LENGTH:
            raise PollError(f"record {n}: id and time are longer than {MAX_EVENT_ID_LENGTH}")
        return record

    def _server_time(self, body: Any, headers: dict[str, str]) -> datetime | None:
        if self.config["server_time_path"]:
            return _parse_time(_dig(body, self.config["server_time_path"]))
        try:
            return parsedate_to_datetime(headers["date"]).astimezone(UTC)
        except (KeyError, TypeError, ValueError):
            return None


def _parse_time(value: Any) -> datetime | None:
    return _from_unix(value) if isinstance(value, int | float) else _from_iso(value)


ADAPTERS: dict[str, Callable[..., PollAdapter]] = {"http_json": HttpJsonAdapter}


def adapter_for(poll_source) -> PollAdapter:
    """The poll source's adapter. Its requests may reach what EGRESS_ALLOW_NETWORKS and
    the networks staff opened for the source's tenant admit (none of an endpoint's: a
    poll source is no endpoint); the operator's own sources (no tenant) the first only."""
    policy = egress_policy_for(tenant_id=poll_source.tenant_id)
    return ADAPTERS[poll_source.adapter](
        poll_source.config, auth_secret=poll_source.auth_secret, policy=policy
    )


# --- The cursor and the walk over the pages ---------------------------------------------


@dataclass(frozen=True)
class Cursor:
    """The highest ``updated_at`` stored and the ids stored at exactly that time."""

    at: datetime | None = None
    ids: frozenset[str] = frozenset()

    def seen(self, record: Record) -> bool:
        return record.updated_at == self.at and record.id in self.ids

    def advanced(self, records: list[Record]) -> Cursor:
        if not records:
            return self
        top = max(r.updated_at for r in records)
        if self.at is not None and top < self.at:
            return self  # never backwards (a provider answering out of order)
        ids = set(self.ids) if top == self.at else set()
        ids.update(r.id for r in records if r.updated_at == top)
        return Cursor(top, frozenset(ids))


@dataclass
class PageResult:
    """What one page brought, handed to ``store``."""

    fresh: list[Record]  # to store
    skipped: int  # already stored at the cursor's time
    cursor: Cursor  # the cursor once ``fresh`` is stored
    page: Page


@dataclass
class Walk:
    pages: int = 0
    requests: int = 0
    records: int = 0
    signpost: datetime | None = None
    reached_end: bool = False
    cursor: Cursor = field(default_factory=Cursor)


def read_changes(
    adapter: PollAdapter,
    *,
    cursor: Cursor,
    page_size: int,
    until: datetime | None = None,
    before_request: Callable[[], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    max_pages: int | None = None,
) -> Iterator[PageResult]:
    """Walk the listing from ``cursor``, yielding each page's new records and the cursor
    to store with them. The caller stores, then asks for the next page; the walk stops at
    the end of the listing, at the first record at or after the stop time (``until`` if
    given, else the signpost: the provider's time at its first answer, or our clock if it
    gives none), after ``max_pages``, or when ``should_stop()``."""
    since = cursor.at
    token: str | None = None
    stop_at = until
    pages = 0
    while not should_stop() and (max_pages is None or pages < max_pages):
        if before_request is not None:
            before_request()
        asked_at = datetime.now(UTC)
        page = adapter.list_changed(since=since, page_token=token, page_size=page_size)
        pages += 1
        if stop_at is None:
            stop_at = page.server_time or asked_at
        in_window = [r for r in page.records if r.updated_at < stop_at]
        fresh = [r for r in in_window if not cursor.seen(r)]
        cursor = cursor.advanced(in_window)
        yield PageResult(fresh=fresh, skipped=len(in_window) - len(fresh), cursor=cursor, page=page)
        if len(in_window) < len(page.records) or page.next_token is None:
            return
        token = page.next_token


class TokenBucket:
    """At most ``rate`` takes per second on average. The bucket holds up to ``burst``
    tokens (default: one second's worth) so that a slow page is made up for by the next
    requests, but it starts with one, so a run never opens with a burst."""

    def __init__(
        self, rate: float, burst: float | None = None, *, clock=time.monotonic, sleep=time.sleep
    ):
        if not rate > 0:
            raise ValueError("the rate must be positive")
        self.rate, self.burst = rate, max(burst if burst is not None else rate, 1.0)
        self._clock, self._sleep = clock, sleep
        self._tokens, self._last = 1.0, clock()

    def take(self) -> None:
        while True:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            if self._tokens >= 1:
                self._tokens -= 1
                return
            self._sleep((1 - self._tokens) / self.rate)
