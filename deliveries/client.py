"""A small typed Python client of the customer REST API, for a host's back office, its
scripts and the docs' examples. Standard library only (``urllib``): it imports nothing
of Django and runs wherever Python 3.11 does.

    from deliveries.client import WebhooksClient

    api = WebhooksClient("https://webhooks.example.com/api/v1/", api_key)
    endpoint = api.create_endpoint("https://hooks.example.com/billing", event_types=["invoice.*"])
    print(endpoint["secret"])  # shown once
    api.publish("invoice.paid", {"invoice_id": "in_1029"}, idempotency_key="in_1029")
    for delivery in api.list_deliveries(state="dead"):
        api.replay(delivery["id"])

Every error answer raises ``ApiError`` with the API's ``code``, ``message`` and
``details`` (docs/api.md, "Errors"). Lists are iterators that follow the cursor pages.
Redirects are not followed: the API key is never sent anywhere but ``base_url``.
"""

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any, NotRequired, TypedDict

__all__ = [
    "ApiError",
    "Attempt",
    "Delivery",
    "Endpoint",
    "EndpointWithSecret",
    "Event",
    "EventType",
    "PortalLink",
    "SecretRotation",
    "WebhooksClient",
]


class Endpoint(TypedDict):
    id: str
    url: str
    description: str
    event_types: list[str]
    enabled: bool
    disabled_reason: str
    disabled_at: str | None
    failing_since: str | None
    rate_limit: float | None
    max_concurrency: int | None
    timeout: float | None
    header_names: list[str]
    retry_client_errors: bool
    paused: NotRequired[bool]
    paused_at: NotRequired[str | None]
    paused_reason: NotRequired[str]
    created_at: str
    updated_at: str


class EndpointWithSecret(Endpoint):
    secret: str


class SecretRotation(TypedDict):
    secret: str
    previous_secrets_expire_at: str | None


class Event(TypedDict):
    id: str
    event_type: str
    payload_version: int
    payload: dict[str, Any]
    entity_id: str
    priority: int
    created_at: str


class Delivery(TypedDict):
    id: str
    event_id: str
    event_type: str
    endpoint_id: str
    state: str
    attempt_count: int
    next_attempt_at: str
    last_attempt_at: str | None
    last_status_code: int | None
    last_outcome: str
    created_at: str
    finished_at: str | None
    explanation: str


class Attempt(TypedDict):
    number: int
    started_at: str
    duration_ms: float
    status_code: int | None
    outcome: str
    error_kind: str
    error: str
    ambiguous: bool
    response_body: str
    response_truncated: bool
    request_headers: dict[str, str]


class EventTypeVersion(TypedDict):
    version: int
    schema: dict[str, Any]
    example: Any
    created_at: str


class EventType(TypedDict):
    name: str
    group: str
    description: str
    owner: str
    validation: str
    versions: list[EventTypeVersion]


class PortalLink(TypedDict):
    url: str
    expires_at: str


class ApiError(Exception):
    """An error answer of the API, in its one shape: ``{"error": {"code", "message",
    "details"?}}``; ``retry_after`` is the seconds a 429 asks to wait."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        details: Any = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.details = details
        self.retry_after = retry_after


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # the 3xx is raised as an HTTPError, the key stays here


def _time(value: datetime) -> str:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError("give an aware datetime: the API refuses a time without its offset")
    return value.isoformat()


class WebhooksClient:
    """The API under ``base_url`` (the ``/api/v1/`` URL, wherever the host mounted it),
    as the tenant whose API key this is."""

    def __init__(self, base_url: str, api_key: str, *, timeout: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/") + "/"
        self._key = api_key
        self.timeout = timeout
        self._opener = urllib.request.build_opener(_NoRedirects())

    def __repr__(self) -> str:  # never the key
        return f"WebhooksClient({self.base_url!r})"

    # --- The wire ---------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, dict[str, str], Any]:
        """One request; returns (status, headers, parsed JSON or None). ``path`` is
        relative to ``base_url``, or a whole URL the API gave (a ``next`` link)."""
        url = path if path.startswith(("http://", "https://")) else self.base_url + path
        query = {k: _param(v) for k, v in (params or {}).items() if v is not None}
        if query:
            url += ("&" if "?" in url else "?") + urllib.parse.urlencode(query)
        if not url.startswith(self.base_url):
            raise ValueError(f"{url!r} is not under {self.base_url!r}")
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method)  # noqa: S310 (http(s) base)
        request.add_header("Authorization", f"Bearer {self._key}")
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            request.add_header(name, value)
        try:
            with self._opener.open(request, timeout=self.timeout) as response:
                raw = response.read()
                status, answer_headers = response.status, dict(response.headers.items())
        except urllib.error.HTTPError as exc:
            raise _error(exc) from None
        return status, answer_headers, json.loads(raw) if raw else None

    def _pages(self, path: str, params: Mapping[str, Any]) -> Iterator[dict]:
        _, _, page = self.request("GET", path, params=params)
        while True:
            yield from page["results"]
            if not page.get("next"):
                return
            _, _, page = self.request("GET", page["next"])

    # --- Endpoints --------------------------------------------------------------------

    def list_endpoints(self, *, limit: int | None = None) -> Iterator[Endpoint]:
        return self._pages("endpoints/", {"limit": limit})

    def create_endpoint(
        self, url: str, *, event_types: list[str] | tuple[str, ...] = (), **options: Any
    ) -> EndpointWithSecret:
        """A new endpoint; its ``secret`` is in this answer only. ``options``: the API's
        other fields (``description``, ``rate_limit``, ``max_concurrency``, ``timeout``,
        ``headers``, ``retry_client_errors``)."""
        body = {"url": url, "event_types": list(event_types), **options}
        return self.request("POST", "endpoints/", body=body)[2]

    def get_endpoint(self, endpoint_id: str) -> Endpoint:
        return self.request("GET", f"endpoints/{_id(endpoint_id)}/")[2]

    def update_endpoint(self, endpoint_id: str, **changes: Any) -> Endpoint:
        return self.request("PATCH", f"endpoints/{_id(endpoint_id)}/", body=changes)[2]

    def delete_endpoint(self, endpoint_id: str) -> None:
        self.request("DELETE", f"endpoints/{_id(endpoint_id)}/")

    def rotate_secret(self, endpoint_id: str) -> SecretRotation:
        return self.request("POST", f"endpoints/{_id(endpoint_id)}/rotate-secret/")[2]

    def pause(self, endpoint_id: str, *, reason: str = "") -> Endpoint:
        """Hold the endpoint's deliveries (none is lost) until ``resume``."""
        body = {"reason": reason} if reason else {}
        return self.request("POST", f"endpoints/{_id(endpoint_id)}/pause/", body=body)[2]

    def resume(self, endpoint_id: str) -> Endpoint:
        return self.request("POST", f"endpoints/{_id(endpoint_id)}/resume/")[2]

    def send_test(self, endpoint_id: str) -> Event:
        return self.request("POST", f"endpoints/{_id(endpoint_id)}/test/")[2]

    # --- Events -----------------------------------------------------------------------

    def publish(
        self,
        event_type: str,
        payload: dict[str, Any],
        *,
        entity_id: str | None = None,
        priority: int | None = None,
        payload_version: int | None = None,
        deliver_at: datetime | None = None,
        idempotency_key: str | None = None,
    ) -> Event:
        """Publish an event. With ``idempotency_key`` a retry of the same call returns
        the same event and creates nothing."""
        body: dict[str, Any] = {"event_type": event_type, "payload": payload}
        optional = {
            "entity_id": entity_id,
            "priority": priority,
            "payload_version": payload_version,
            "deliver_at": _time(deliver_at) if deliver_at is not None else None,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return self.request("POST", "events/", body=body, headers=headers)[2]

    def list_events(self, **filters: Any) -> Iterator[Event]:
        """Filters: ``event_type``, ``entity_id``, ``created_after``, ``created_before``
        (aware datetimes), ``limit``."""
        return self._pages("events/", filters)

    def get_event(self, event_id: str) -> Event:
        return self.request("GET", f"events/{_id(event_id)}/")[2]

    # --- Deliveries -------------------------------------------------------------------

    def list_deliveries(self, **filters: Any) -> Iterator[Delivery]:
        """Newest first. Filters: ``state``, ``endpoint_id``, ``event_id``,
        ``event_type``, ``created_after``, ``created_before``, ``limit``."""
        return self._pages("deliveries/", filters)

    def get_delivery(self, delivery_id: str) -> Delivery:
        return self.request("GET", f"deliveries/{_id(delivery_id)}/")[2]

    def list_attempts(self, delivery_id: str) -> Iterator[Attempt]:
        return self._pages(f"deliveries/{_id(delivery_id)}/attempts/", {})

    def replay(self, delivery_id: str) -> int:
        return self.request("POST", f"deliveries/{_id(delivery_id)}/replay/")[2]["count"]

    def recover(self, since: datetime, *, endpoint_id: str | None = None) -> int:
        """Replay the dead deliveries that died since ``since`` (14 days back at most)."""
        body = {"since": _time(since)}
        if endpoint_id:
            body["endpoint_id"] = endpoint_id
        return self.request("POST", "deliveries/recover/", body=body)[2]["count"]

    # --- The catalogue and the portal -------------------------------------------------

    def list_event_types(self, *, group: str | None = None) -> Iterator[EventType]:
        return self._pages("event-types/", {"group": group})

    def portal_link(self, *, ttl: int | None = None) -> PortalLink:
        """A short-lived, single-use link that opens this tenant's portal."""
        body = {"ttl": ttl} if ttl is not None else {}
        return self.request("POST", "portal-link/", body=body)[2]


def _id(value: Any) -> str:
    return urllib.parse.quote(str(value), safe="")


def _param(value: Any) -> str:
    if isinstance(value, datetime):
        return _time(value)
    return str(value)


def _error(exc: urllib.error.HTTPError) -> ApiError:
    raw = exc.read()
    retry_after = exc.headers.get("Retry-After")
    try:
        error = json.loads(raw)["error"]
        code, message, details = error["code"], error["message"], error.get("details")
    except (ValueError, KeyError, TypeError):
        code, message, details = "http_error", f"HTTP {exc.code}", None
    return ApiError(exc.code, code, message, details, float(retry_after) if retry_after else None)
