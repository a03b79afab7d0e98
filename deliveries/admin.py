"""The operator's console: read-only history, and actions that call services and write an
audit row in the same transaction. Viewing a page needs the view permission on its
model; every action that changes anything declares its own permission (``permissions=``),
listed in docs/operations.md, "Admin permissions"."""

import json
from collections import Counter
from datetime import timedelta

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db import OperationalError, connection, transaction
from django.db.models import Avg, Count, Max, Q
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html, format_html_join
from django_q import admin as q_admin  # registers django-q2's admins, replaced below
from django_q.models import Failure, Success

from . import services
from .jobs.admin import TenantFilter
from .jobs.admin import uuid_or_none as _uuid
from .jobs.confirm import Operation, Selection, confirm_operation
from .jobs.models import LoopRun
from .models import (
    ApiKey,
    Attempt,
    AuditEntry,
    Delivery,
    DeliveryState,
    EgressAllowance,
    Endpoint,
    Event,
    EventType,
    EventTypeVersion,
    OperationalEvent,
    Tenant,
)
from .selectors import attempt_request_headers, delivery_explain

STATE_COLOURS = {
    DeliveryState.PENDING: "#b7791f",
    DeliveryState.ENQUEUED: "#2b6cb0",
    DeliveryState.LEASED: "#6b46c1",
    DeliveryState.SUCCEEDED: "#2f855a",
    DeliveryState.DEAD: "#c53030",
    "held": "#4a5568",
}


DELIVERY_OPERATIONS = {
    "replay": Operation(
        name="replay",
        noun=("delivery", "deliveries"),
        type_label="event type",
        explanation="Each goes back to <em>pending</em>, due now, with a fresh retry budget "
        "and the <strong>same webhook-id</strong>, so receivers can recognise a copy. "
        "Deliveries in flight are left alone.",
        done="returned to pending",
        unsafe_warning="Some of these event types are not marked replay-safe: a receiver "
        "that is not idempotent for them may act twice.",
    ),
    "cancel": Operation(
        name="cancel",
        noun=("delivery", "deliveries"),
        type_label="event type",
        explanation="Pending and enqueued deliveries become <em>dead</em> (cancelled). A "
        "delivery mid-request cannot be recalled.",
        done="cancelled",
    ),
}


def state_badge(state: str):
    return format_html(
        '<span class="state-badge" style="background:{};color:#fff;padding:1px 6px;'
        'border-radius:8px;font-size:11px">{}</span>',
        STATE_COLOURS.get(state, "#4a5568"),
        state,
    )


class CappedCountPaginator(Paginator):
    """Counting every row of a table of millions on each page view is what makes admin
    logs slow. Count at most CAP + 1 rows, and on PostgreSQL give the count at most
    COUNT_BUDGET_MS: past either, the page shows CAP + 1 (read it as "many")."""

    CAP = 10_000
    COUNT_BUDGET_MS = 100

    @cached_property
    def count(self) -> int:
        capped = self.counted().order_by()[: self.CAP + 1]
        if connection.vendor != "postgresql":
            return capped.count()
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SET LOCAL statement_timeout = %s", [self.COUNT_BUDGET_MS])
                return capped.count()
        except OperationalError:  # the count ran out of time: a lot of rows
            return self.CAP + 1

    def counted(self):
        return self.object_list


class DeliveryLogPaginator(CappedCountPaginator):
    """The delivery log's pages are read through an inner join to the listing: through
    the outer join Django makes for the ordering's reverse one-to-one, PostgreSQL cannot
    read the deliveries in the listing indexes' order, and sorts the table. The count
    counts the rows as filtered, joining the listing only where a filter reads it (every
    delivery has its listing row): a state or outcome filter counts from the delivery's
    own partial indexes."""

    def __init__(self, object_list, *args, **kwargs):
        self.filtered = object_list
        super().__init__(object_list.filter(listing__isnull=False), *args, **kwargs)

    def counted(self):
        return self.filtered


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


# --- Filters ---------------------------------------------------------------------------


class DeliveryTenantFilter(TenantFilter):
    # The listing's (tenant, delivery) index: the delivery row has none on its tenant.
    field = "listing__tenant_id"


class EndpointFilter(admin.SimpleListFilter):
    """Set by the links on the endpoint and dead-letter pages; lists only the endpoint
    chosen, so the filter never loads every endpoint."""

    title = "endpoint"
    parameter_name = "endpoint"

    def lookups(self, request, model_admin):
        value = _uuid(self.value())
        endpoint = Endpoint.objects.filter(id=value).first() if value else None
        return [(str(endpoint.id), endpoint.url)] if endpoint else []

    def queryset(self, request, queryset):
        # Both copies of the endpoint: the listing's indexes give the order, and the
        # delivery's partial indexes that lead with it (delivery_dead, due_endpoint)
        # serve a state filter with it, as the dead-letter page's links set.
        value = _uuid(self.value())
        if not value:
            return queryset
        return queryset.filter(listing__endpoint_id=value, endpoint_id=value)


class EventTypeFilter(admin.SimpleListFilter):
    title = "event type"
    parameter_name = "event_type"

    def lookups(self, request, model_admin):
        return [(t, t) for t in EventType.objects.order_by("name").values_list("name", flat=True)]

    def queryset(self, request, queryset):
        return queryset.filter(event__event_type=self.value()) if self.value() else queryset


class PausedFilter(admin.SimpleListFilter):
    title = "paused"
    parameter_name = "paused"

    def lookups(self, request, model_admin):
        return [("yes", "Paused"), ("no", "Not paused")]

    def queryset(self, request, queryset):
        if self.value() in ("yes", "no"):
            return queryset.filter(paused_at__isnull=self.value() == "no")
        return queryset


# --- Deliveries ------------------------------------------------------------------------


class AttemptInline(admin.TabularInline):
    model = Attempt
    fields = [
        "number",
        "started_at",
        "duration_ms",
        "status_code",
        "outcome",
        "error_kind",
        "ambiguous",
        "recorded",
        "response_excerpt",
    ]
    readonly_fields = fields
    extra = 0
    can_delete = False
    ordering = ["number", "id"]
    verbose_name_plural = "attempt timeline"

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    @admin.display(description="response")
    def response_excerpt(self, attempt):
        text = attempt.error or attempt.response_body
        return (text[:300] + "…") if len(text) > 300 else text


@admin.register(Delivery)
class DeliveryAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "badge",
        "tenant",
        "endpoint_url",
        "event_type",
        "attempt_count",
        "next_attempt_at",
        "last_status_code",
        "last_outcome",
        "created_at",
    ]
    list_filter = [
        "state",
        DeliveryTenantFilter,
        EndpointFilter,
        EventTypeFilter,
        "last_outcome",
        # The listing's copy of the creation time, which listing_created ranges over.
        ("listing__created_at", admin.DateFieldListFilter),
    ]
    search_help_text = "A delivery id (webhook-id), an event id, or an entity id."
    search_fields = ["event__entity_id"]  # ids are matched exactly in get_search_results
    list_select_related = ["endpoint", "tenant", "event"]
    show_full_result_count = False
    paginator = DeliveryLogPaginator
    list_per_page = 50
    # The listing's creation time: its indexes give this order, in all and under the
    # tenant and endpoint filters (models.DeliveryListing); the delivery row has none.
    ordering = ["-listing__created_at", "-id"]
    inlines = [AttemptInline]
    actions = ["replay_selected", "cancel_selected"]
    readonly_fields = [
        "where_it_stands",
        "badge",
        "id",
        "event_link",
        "endpoint",
        "tenant",
        "attempt_count",
        "policy_attempts",
        "dispatch_count",
        "lease_expiries",
        "next_attempt_at",
        "enqueued_at",
        "lease_until",
        "last_outcome",
        "last_status_code",
        "last_error",
        "last_attempt_at",
        "created_at",
        "finished_at",
        "headers_sent",
        "event_body",
    ]
    fieldsets = [
        (None, {"fields": ["where_it_stands", "badge", "id", "event_link", "endpoint", "tenant"]}),
        (
            "Counters",
            {"fields": ["attempt_count", "policy_attempts", "dispatch_count", "lease_expiries"]},
        ),
        (
            "Clock",
            {
                "fields": [
                    "created_at",
                    "next_attempt_at",
                    "enqueued_at",
                    "lease_until",
                    "last_attempt_at",
                    "finished_at",
                ]
            },
        ),
        ("Last outcome", {"fields": ["last_outcome", "last_status_code", "last_error"]}),
        ("What was sent", {"fields": ["headers_sent", "event_body"]}),
    ]
    change_form_template = "admin/deliveries/delivery/change_form.html"

    def get_paginator(self, request, queryset, per_page, orphans=0, allow_empty_first_page=True):
        # The History page pages the admin's LogEntry rows, which have no listing to join.
        paginator = DeliveryLogPaginator if queryset.model is Delivery else CappedCountPaginator
        return paginator(queryset, per_page, orphans, allow_empty_first_page)

    def get_search_results(self, request, queryset, search_term):
        """Exact matches on the delivery id, the event id or the entity id. Each is its
        own indexed lookup: one OR across the event join would scan the whole table."""
        term = search_term.strip()
        if not term:
            return queryset, False
        as_uuid = _uuid(term)
        events = list(Event.objects.filter(entity_id=term).values_list("id", flat=True)[:1000])
        if as_uuid:
            events.append(as_uuid)
        ids = set(Delivery.objects.filter(event_id__in=events).values_list("id", flat=True)[:1000])
        if as_uuid:
            ids |= set(Delivery.objects.filter(id=as_uuid).values_list("id", flat=True))
        return queryset.filter(id__in=ids), False

    def has_replay_permission(self, request):
        return request.user.has_perm("deliveries.replay_delivery")

    @admin.display(description="state", ordering="state")
    def badge(self, d):
        if d.state == DeliveryState.PENDING and d.endpoint.paused_at is not None:
            # Not a state of its own: a pending delivery its paused endpoint holds.
            return format_html("{} {}", state_badge(d.state), state_badge("held"))
        return state_badge(d.state)

    @admin.display(description="endpoint")
    def endpoint_url(self, d):
        return d.endpoint.url

    @admin.display(description="event type")
    def event_type(self, d):
        return d.event.event_type

    @admin.display(description="where it stands")
    def where_it_stands(self, d):
        return delivery_explain(d).sentence

    @admin.display(description="event")
    def event_link(self, d):
        url = reverse("admin:deliveries_event_change", args=[d.event_id])
        return format_html('<a href="{}">{} {}</a>', url, d.event.event_type, d.event_id)

    @admin.display(description="headers sent (last attempt)")
    def headers_sent(self, d):
        attempt = d.attempts.order_by("-number", "-id").first()
        if attempt is None:
            return "no attempt yet"
        headers = attempt_request_headers(attempt).items()
        return format_html_join("", "<div><code>{}: {}</code></div>", headers)

    @admin.display(description="body")
    def event_body(self, d):
        return _pretty_body(d.event.body)

    # Replay and cancel: a confirmation page that shows the rows and event types first.

    @admin.action(
        description="Replay selected deliveries (same webhook-id)", permissions=["replay"]
    )
    def replay_selected(self, request, queryset):
        return self._confirm(request, queryset, "replay")

    @admin.action(description="Cancel selected deliveries (not yet sent)", permissions=["replay"])
    def cancel_selected(self, request, queryset):
        return self._confirm(request, queryset, "cancel")

    def _confirm(self, request, queryset, operation, back=""):
        """The one rule for replaying and cancelling, from the action and the delivery
        page's button alike (deliveries.jobs.confirm): a confirmation page first, and for
        a replay of any event type not marked replay-safe an extra confirmation. Returns
        None once done."""
        ids = list(queryset.values_list("id", flat=True)[:10_001])
        if len(ids) > 10_000:
            self.message_user(request, "Select at most 10,000 deliveries.", messages.ERROR)
            return None
        types = Counter(
            Delivery.objects.filter(id__in=ids).values_list("event__event_type", flat=True)
        )
        known = EventType.objects.filter(name__in=types)
        selection = Selection(
            ids=ids,
            types=types,
            safe=set(known.filter(replay_safe=True).values_list("name", flat=True)),
            owners=dict(known.values_list("name", "owner")),
        )
        service = services.delivery_replay if operation == "replay" else services.delivery_cancel
        return confirm_operation(
            self,
            request,
            DELIVERY_OPERATIONS[operation],
            selection,
            run=lambda ids: service(delivery_ids=ids, actor=request.user, via="admin"),
            back=back or reverse("admin:deliveries_delivery_changelist"),
        )

    def get_urls(self):
        return [
            path(
                "dead-letters/",
                self.admin_site.admin_view(self.dead_letters_view),
                name="deliveries_delivery_dead_letters",
            ),
            path(
                "<uuid:delivery_id>/replay/",
                self.admin_site.admin_view(self.replay_one),
                name="deliveries_delivery_replay",
            ),
            *super().get_urls(),
        ]

    def replay_one(self, request, delivery_id):
        """The delivery page's Replay button: the bulk action's confirmation, for one."""
        page = reverse("admin:deliveries_delivery_change", args=[delivery_id])
        if not self.has_view_permission(request):
            raise PermissionDenied
        if not self.has_replay_permission(request):
            self.message_user(
                request, "You may view deliveries but not replay them.", messages.ERROR
            )
            return HttpResponseRedirect(page)
        if request.method != "POST":
            return HttpResponseRedirect(page)
        delivery = Delivery.objects.filter(id=delivery_id)
        return self._confirm(request, delivery, "replay", back=page) or HttpResponseRedirect(page)

    def render_change_form(self, request, context, *args, **kwargs):
        context["has_replay_permission"] = self.has_replay_permission(request)
        return super().render_change_form(request, context, *args, **kwargs)

    def dead_letters_view(self, request):
        """Dead deliveries grouped by endpoint and reason, largest groups first."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        # Grouped on the delivery table alone, from the delivery_dead index (Count("*"),
        # not Count("id"), so PostgreSQL need not visit the rows).
        groups = list(
            Delivery.objects.filter(state=DeliveryState.DEAD)
            .values("endpoint_id", "last_outcome")
            .annotate(count=Count("*"), latest=Max("finished_at"))
            .order_by("-count")[:200]
        )
        endpoints = Endpoint.objects.select_related("tenant").in_bulk(
            {g["endpoint_id"] for g in groups}
        )
        changelist = reverse("admin:deliveries_delivery_changelist")
        rows = [
            {
                **g,
                "endpoint__url": endpoints[g["endpoint_id"]].url,
                "tenant__name": endpoints[g["endpoint_id"]].tenant.name,
                "link": f"{changelist}?state=dead&endpoint={g['endpoint_id']}"
                f"&last_outcome={g['last_outcome']}",
            }
            for g in groups
        ]
        context = {
            **self.admin_site.each_context(request),
            "title": "Dead letters",
            "rows": rows,
            "opts": self.model._meta,
        }
        return TemplateResponse(request, "admin/deliveries/dead_letters.html", context)


def _pretty_body(body) -> str:
    raw = bytes(body)
    try:
        text = json.dumps(json.loads(raw), indent=2, ensure_ascii=False)
    except ValueError:
        text = raw.decode("utf-8", errors="replace")
    if len(text) > 20_000:
        text = text[:20_000] + "\n… (truncated)"
    return format_html("<pre style='max-height:30em;overflow:auto'>{}</pre>", text)


# --- Endpoints -------------------------------------------------------------------------


@admin.register(Endpoint)
class EndpointAdmin(admin.ModelAdmin):
    list_display = [
        "url",
        "tenant",
        "enabled",
        "paused_at",
        "success_rate_24h",
        "mean_latency_24h",
        "failing_since",
        "disabled_reason",
        "deliveries_link",
    ]
    list_filter = ["enabled", PausedFilter, TenantFilter]
    search_fields = ["url"]
    fields = [
        "tenant",
        "url",
        "description",
        "event_types",
        "enabled",
        "disabled_reason",
        "disabled_at",
        "paused_at",
        "paused_reason",
        "failing_since",
        "rate_limit",
        "max_concurrency",
        "timeout",
        "retry_client_errors",
    ]
    readonly_fields = [
        "enabled",
        "failing_since",
        "disabled_at",
        "disabled_reason",
        "paused_at",
        "paused_reason",
    ]
    actions = ["pause", "resume", "enable", "disable", "rotate_secret"]
    show_full_result_count = False

    def get_changelist_instance(self, request):
        changelist = super().get_changelist_instance(request)
        # Health over the last 24 h for the endpoints on this page only: one query.
        ids = [e.id for e in changelist.result_list]
        since = timezone.now() - timedelta(hours=24)
        stats = {
            row["endpoint_id"]: row
            for row in Attempt.objects.filter(endpoint_id__in=ids, started_at__gte=since)
            .values("endpoint_id")
            .annotate(
                total=Count("id"),
                ok=Count("id", filter=Q(outcome="success")),
                latency=Avg("duration_ms"),
            )
        }
        for endpoint in changelist.result_list:
            endpoint.health = stats.get(endpoint.id)
        return changelist

    @admin.display(description="success 24 h")
    def success_rate_24h(self, endpoint):
        h = getattr(endpoint, "health", None)
        return f"{100 * h['ok'] / h['total']:.1f}% of {h['total']}" if h else "—"

    @admin.display(description="mean latency 24 h")
    def mean_latency_24h(self, endpoint):
        h = getattr(endpoint, "health", None)
        return f"{h['latency']:.0f} ms" if h else "—"

    @admin.display(description="deliveries")
    def deliveries_link(self, endpoint):
        url = reverse("admin:deliveries_delivery_changelist") + f"?endpoint={endpoint.id}"
        return format_html('<a href="{}">log</a>', url)

    def has_rotate_secret_permission(self, request):
        return request.user.has_perm("deliveries.rotate_secret")

    def has_pause_permission(self, request):
        return request.user.has_perm("deliveries.pause_endpoint")

    @admin.action(
        description="Pause selected endpoints (hold their deliveries)", permissions=["pause"]
    )
    def pause(self, request, queryset):
        n = sum(
            services.endpoint_pause(
                endpoint=e, actor=request.user, reason="paused by staff", via="admin"
            )
            for e in queryset
        )
        self.message_user(
            request,
            f"{n} endpoints paused: their deliveries wait, none is dead-lettered.",
            messages.SUCCESS,
        )

    @admin.action(description="Resume selected endpoints", permissions=["pause"])
    def resume(self, request, queryset):
        n = sum(
            services.endpoint_resume(endpoint=e, actor=request.user, via="admin") for e in queryset
        )
        self.message_user(
            request, f"{n} endpoints resumed: their held deliveries are due.", messages.SUCCESS
        )

    @admin.action(description="Enable selected endpoints", permissions=["change"])
    def enable(self, request, queryset):
        n = sum(services.endpoint_enable(endpoint=e, actor=request.user) for e in queryset)
        self.message_user(request, f"{n} endpoints enabled.", messages.SUCCESS)

    @admin.action(description="Disable selected endpoints", permissions=["change"])
    def disable(self, request, queryset):
        n = sum(
            services.endpoint_disable(endpoint=e, reason="disabled by staff", actor=request.user)
            for e in queryset
        )
        self.message_user(request, f"{n} endpoints disabled.", messages.SUCCESS)

    @admin.action(
        description="Rotate the signing secret (old one signs for 24 h more)",
        permissions=["rotate_secret"],
    )
    def rotate_secret(self, request, queryset):
        for endpoint in queryset:
            secret = services.endpoint_rotate_secret(endpoint=endpoint, actor=request.user)
            self.message_user(
                request,
                f"New secret for {endpoint.url} (shown once; give it to the tenant): {secret}",
                messages.WARNING,
            )


# --- The rest --------------------------------------------------------------------------


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["name", "id", "external_id", "time_zone", "created_at"]
    search_fields = ["name", "=external_id"]
    actions = ["create_api_key"]

    def has_create_api_key_permission(self, request):
        return request.user.has_perm("deliveries.create_api_key")

    @admin.action(description="Create an API key (shown once)", permissions=["create_api_key"])
    def create_api_key(self, request, queryset):
        for tenant in queryset:
            _, key = services.api_key_create(tenant=tenant, name="admin", actor=request.user)
            self.message_user(
                request, f"API key for {tenant.name} (shown once): {key}", messages.WARNING
            )


@admin.register(EgressAllowance)
class EgressAllowanceAdmin(admin.ModelAdmin):
    """Networks opened for one tenant (or endpoint) past the egress guard. Adding,
    changing and deleting need their own model permissions, and each is audited."""

    list_display = ["network", "tenant", "endpoint", "note", "created_by", "created_at"]
    list_filter = [TenantFilter]
    search_fields = ["network", "note", "tenant__name"]
    list_select_related = ["tenant", "endpoint", "created_by"]
    raw_id_fields = ["endpoint"]
    readonly_fields = ["created_by", "created_at"]

    def save_model(self, request, obj, form, change):
        services.egress_allowance_save(allowance=obj, actor=request.user)

    def delete_model(self, request, obj):
        services.egress_allowances_delete(allowance_ids=[obj.pk], actor=request.user)

    def delete_queryset(self, request, queryset):
        services.egress_allowances_delete(
            allowance_ids=list(queryset.values_list("pk", flat=True)), actor=request.user
        )


@admin.register(ApiKey)
class ApiKeyAdmin(ReadOnlyAdmin):
    list_display = ["prefix", "tenant", "name", "created_at", "expires_at", "revoked_at"]
    list_filter = [TenantFilter]
    fields = ["prefix", "tenant", "name", "created_at", "expires_at", "revoked_at"]
    # Only the expiry is edited here, and through the audited service (save_model).
    readonly_fields = ["prefix", "tenant", "name", "created_at", "revoked_at"]
    actions = ["revoke"]

    def save_model(self, request, obj, form, change):
        if change and "expires_at" in form.changed_data:
            services.api_key_set_expiry(
                key_id=obj.pk, expires_at=form.cleaned_data["expires_at"], actor=request.user
            )

    @admin.action(description="Revoke selected keys", permissions=["change"])
    def revoke(self, request, queryset):
        n = services.api_keys_revoke(
            key_ids=list(queryset.values_list("id", flat=True)), actor=request.user
        )
        self.message_user(request, f"{n} keys revoked.", messages.SUCCESS)

    def has_change_permission(self, request, obj=None):
        return request.user.has_perm("deliveries.change_apikey")


class EventTypeVersionInline(admin.StackedInline):
    # A payload version's schema and example, validated by the model (a JSON Schema the
    # library accepts, an example that matches it).
    model = EventTypeVersion
    extra = 0
    fields = ["version", "schema", "example"]


@admin.register(EventType)
class EventTypeAdmin(admin.ModelAdmin):
    list_display = ["name", "owner", "validation", "replay_safe", "description"]
    list_editable = ["replay_safe"]
    list_filter = ["validation"]
    search_fields = ["name", "owner"]
    fields = ["name", "owner", "description", "validation", "replay_safe"]
    inlines = [EventTypeVersionInline]


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    list_display = ["id", "event_type", "tenant", "entity_id", "priority", "created_at"]
    list_filter = [TenantFilter]
    fields = [
        "id",
        "tenant",
        "event_type",
        "payload_version",
        "entity_id",
        "priority",
        "idempotency_key",
        "created_at",
        "body_pretty",
    ]
    readonly_fields = fields
    paginator = CappedCountPaginator
    show_full_result_count = False
    ordering = ["-created_at"]

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip()
        if not term:
            return queryset, False
        as_uuid = _uuid(term)
        condition = Q(entity_id=term) | (Q(id=as_uuid) if as_uuid else Q(pk__in=[]))
        return queryset.filter(condition), False

    search_fields = ["entity_id"]

    @admin.display(description="body")
    def body_pretty(self, event):
        return _pretty_body(event.body)


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "actor", "action", "target", "count", "details"]
    list_filter = ["action"]
    paginator = CappedCountPaginator
    show_full_result_count = False


@admin.register(LoopRun)
class LoopRunAdmin(ReadOnlyAdmin):
    list_display = [
        "kind",
        "host",
        "pid",
        "started_at",
        "heartbeat_at",
        "finished_at",
        "ticks",
        "counts",
    ]
    list_filter = ["kind"]
    paginator = CappedCountPaginator
    show_full_result_count = False


@admin.register(OperationalEvent)
class OperationalEventAdmin(ReadOnlyAdmin):
    """Incidents the service recorded about itself (deliveries/alerts.py)."""

    list_display = [
        "first_seen_at",
        "severity",
        "kind",
        "summary",
        "occurrences",
        "last_seen_at",
        "resolved_at",
        "notified_at",
    ]
    list_filter = ["kind", "severity", ("resolved_at", admin.EmptyFieldListFilter)]
    search_fields = ["key", "summary"]
    readonly_fields = [
        "kind",
        "key",
        "severity",
        "summary",
        "details",
        "first_seen_at",
        "last_seen_at",
        "occurrences",
        "resolved_at",
        "notified_at",
        "notification",
    ]
    ordering = ["-first_seen_at"]
    paginator = CappedCountPaginator
    show_full_result_count = False


# --- django-q2's tasks -----------------------------------------------------------------
# django-q2 offers its "resubmit" action to anyone who may view a task list, and deletes
# each failure it resubmits. Here it needs the change permission on the task's model, and
# on failures the delete permission too.


@admin.action(description="Resubmit selected tasks to the queue", permissions=["resubmit"])
def resubmit_tasks(modeladmin, request, queryset):
    return q_admin.resubmit_task(modeladmin, request, queryset)


class SuccessAdmin(q_admin.TaskAdmin):
    actions = [resubmit_tasks]

    def has_resubmit_permission(self, request):
        return self.has_change_permission(request)


class FailureAdmin(q_admin.FailAdmin):
    actions = [resubmit_tasks]

    def has_resubmit_permission(self, request):
        return self.has_change_permission(request) and self.has_delete_permission(request)


for _model, _model_admin in [(Success, SuccessAdmin), (Failure, FailureAdmin)]:
    admin.site.unregister(_model)
    admin.site.register(_model, _model_admin)
