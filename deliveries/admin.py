"""The operator's console: read-only history, and actions that call services and write an
audit row in the same transaction. Viewing a page needs the view permission on its
model; every action that changes anything declares its own permission (``permissions=``),
listed in docs/operations.md, "Admin permissions"."""

import json
import re
from collections import Counter
from datetime import timedelta

from django.contrib import admin, messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Max, Q
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe
from django_q import admin as q_admin  # registers django-q2's admins, replaced below
from django_q.models import Failure, OrmQ, Schedule, Success

from . import overview, selectors, services
from .core import charts as charts_module
from .core.confirm import Operation, Selection, confirm_operation
from .core.console import (
    EMPTY,
    AuditedEdits,
    CappedCountPaginator,
    ConsoleAdmin,
    ReadOnlyAdmin,
    duration,
    key_values,
    state_badge,
    when,
)
from .core.console import (
    panels as console_panels,
)
from .jobs.admin import TenantFilter
from .jobs.admin import uuid_or_none as _uuid
from .jobs.brokers import broker_class, takes_outbox
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
from .selectors import (
    answer_of,
    attempt_request_headers,
    dead_reason,
    delivery_explain,
    outcome_label,
    outcome_sentence,
)
from .statements import reads

# Deliveries one replay by filter takes at most (the API's bulk recovery's ceiling too).
REPLAY_MATCHING_MAX = services.RECOVER_MAX_ROWS

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


# --- Filters ---------------------------------------------------------------------------


class DeliveryTenantFilter(TenantFilter):
    # The listing's (tenant, delivery) index: the delivery row has none on its tenant.
    field = "listing__tenant_id"


class SearchableFilter(admin.SimpleListFilter):
    """A filter that is always there and stays small at any size: a bounded list of
    choices (``SHOWN``, and the one chosen), and a search box above it for the others
    (``<parameter>_q``, matched by ``search``), which narrows the list without filtering
    the rows until a choice is clicked."""

    SHOWN = 30
    template = "admin/deliveries/searchable_filter.html"
    placeholder = ""

    @property
    def search_parameter(self) -> str:
        return f"{self.parameter_name}_q"

    def __init__(self, request, params, model, model_admin):
        raw = params.get(self.search_parameter)
        term = raw[-1] if isinstance(raw, list) else raw
        self.term = (term or "").strip()[:200]
        super().__init__(request, params, model, model_admin)
        # Consumed here: the changelist must not read it as a lookup of its own.
        params.pop(self.search_parameter, None)

    def expected_parameters(self):
        return [self.parameter_name, self.search_parameter]

    def has_output(self):
        return True  # the search box, even before there is anything to list

    def lookups(self, request, model_admin):
        return list(self.search(self.term)[: self.SHOWN]) if self.term else self.first()

    def first(self) -> list[tuple[str, str]]:
        raise NotImplementedError

    def search(self, term: str):
        raise NotImplementedError

    def choices(self, changelist):
        # The search form keeps every other parameter of the page as it is.
        self.hidden = [
            (k, v)
            for k, values in changelist.params.items()
            if k not in (self.parameter_name, self.search_parameter)
            for v in (values if isinstance(values, list) else [values])
        ]
        chosen = self.value()
        listed = {str(value) for value, _ in self.lookup_choices}
        if chosen and chosen not in listed:
            label = self.label_of(chosen)
            if label:
                self.lookup_choices = [(chosen, label), *self.lookup_choices]
        yield from super().choices(changelist)

    def label_of(self, value: str) -> str | None:
        return None


class EndpointFilter(SearchableFilter):
    """The endpoints by URL: the first ones, or those whose URL holds the search term
    (or whose id it is); the overview's, endpoint list's and dead letters' links set it.
    The endpoint table is small beside the deliveries: a search reads it, never them."""

    title = "endpoint"
    parameter_name = "endpoint"
    placeholder = "part of its URL, or its id"

    def first(self):
        return [
            (str(i), url)
            for i, url in Endpoint.objects.order_by("url").values_list("id", "url")[: self.SHOWN]
        ]

    def search(self, term):
        as_uuid = _uuid(term)
        found = Endpoint.objects.filter(
            Q(url__icontains=term) | Q(id=as_uuid) if as_uuid else Q(url__icontains=term)
        )
        return [(str(i), url) for i, url in found.order_by("url").values_list("id", "url")]

    def label_of(self, value):
        value = _uuid(value)
        return (
            Endpoint.objects.filter(id=value).values_list("url", flat=True).first()
            if value
            else None
        )

    def queryset(self, request, queryset):
        # Both copies of the endpoint: the listing's indexes give the order, and the
        # delivery's partial indexes that lead with it (delivery_dead, due_endpoint)
        # serve a state filter with it, as the dead-letter page's links set.
        value = _uuid(self.value())
        if not value:
            return queryset
        return queryset.filter(listing__endpoint_id=value, endpoint_id=value)


class EventTypeFilter(SearchableFilter):
    """The event types in the catalogue and those published (a skip scan of the event
    table's type index, reads.EVENT_TYPES_SEEN: one probe per type, not per event)."""

    title = "event type"
    parameter_name = "event_type"
    placeholder = "part of its name"

    def first(self):
        return [(t, t) for t in self.known()[: self.SHOWN]]

    def search(self, term):
        return [(t, t) for t in self.known() if term.lower() in t.lower()]

    def known(self) -> list[str]:
        seen = {t for (t,) in reads.EVENT_TYPES_SEEN({"most": 500})}
        return sorted(seen | set(EventType.objects.values_list("name", flat=True)[:500]))

    def label_of(self, value):
        return value

    def queryset(self, request, queryset):
        return queryset.filter(event__event_type=self.value()) if self.value() else queryset


class FinishedSinceFilter(admin.SimpleListFilter):
    """When a delivery ended (succeeded or went dead): "replay every dead delivery of
    endpoint E of the last day". With the state dead and an endpoint, the partial index
    delivery_dead (endpoint, finished_at) answers it."""

    title = "ended"
    parameter_name = "ended"
    WINDOWS = {
        "1h": ("in the last hour", 1),
        "24h": ("in the last 24 hours", 24),
        "7d": ("in the last 7 days", 24 * 7),
        "14d": ("in the last 14 days", 24 * 14),
    }

    def lookups(self, request, model_admin):
        return [(key, label) for key, (label, _) in self.WINDOWS.items()]

    def queryset(self, request, queryset):
        window = self.WINDOWS.get(self.value())
        if window is None:
            return queryset
        return queryset.filter(finished_at__gte=timezone.now() - timedelta(hours=window[1]))


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


class AttemptInline(ConsoleAdmin, admin.TabularInline):
    model = Attempt
    fields = [
        "number",
        "started_at",
        "duration_ms",
        "answer",
        "result",
        "flags",
        "response_excerpt",
    ]
    readonly_fields = fields
    extra = 0
    can_delete = False
    ordering = ["number", "id"]
    verbose_name_plural = "attempt timeline"
    classes = ["console-timeline"]

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    @admin.display(description="answer")
    def answer(self, attempt):
        return answer_of(attempt.status_code, "", attempt.error_kind)

    @admin.display(description="outcome")
    def result(self, attempt):
        return outcome_label(attempt.outcome)

    @admin.display(description="flags")
    def flags(self, attempt):
        shown = []
        if attempt.ambiguous:
            shown.append(
                format_html(
                    '<span class="warning-flag" title="{}">ambiguous</span>',
                    "No answer after the request was sent: the receiver may have acted "
                    "on it. The next copy carries the same webhook-id.",
                )
            )
        if not attempt.recorded:
            shown.append(
                format_html(
                    '<span class="quiet" title="{}">evidence only</span>',
                    "Recorded after the worker had lost its lease: it changed nothing.",
                )
            )
        return format_html_join(" ", "{}", ((f,) for f in shown)) if shown else ""

    @admin.display(description="response")
    def response_excerpt(self, attempt):
        """What the receiver answered (or the error), as it came: evidence, shown as text."""
        text = attempt.error or attempt.response_body
        if not text:
            return ""
        return format_html(
            '<pre class="response">{}</pre>', (text[:300] + "…") if len(text) > 300 else text
        )


@admin.register(Delivery)
class DeliveryAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "badge",
        "tenant",
        "endpoint_url",
        "event_type",
        "tries",
        "next_attempt",
        "last_result",
        "created_at",
    ]
    list_filter = [
        "state",
        DeliveryTenantFilter,
        EndpointFilter,
        EventTypeFilter,
        "last_outcome",
        FinishedSinceFilter,
        # The listing's copy of the creation time, which listing_created ranges over.
        ("listing__created_at", admin.DateFieldListFilter),
    ]
    search_help_text = "A delivery id (webhook-id), an event id, or an entity id."
    search_fields = ["event__entity_id"]  # ids are matched exactly in get_search_results
    list_select_related = ["endpoint", "tenant", "event"]
    show_full_result_count = False
    # Counting every filter choice's rows ("Show counts") reads the whole table.
    show_facets = admin.ShowFacets.NEVER
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
        "next_attempt",
        "enqueued_at",
        "lease_until",
        "last_answer",
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
                    "next_attempt",
                    "enqueued_at",
                    "lease_until",
                    "last_attempt_at",
                    "finished_at",
                ]
            },
        ),
        ("Last attempt", {"fields": ["last_answer"]}),
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
        """Its host, then its path: endpoints of one receiver differ by their paths."""
        url = d.endpoint.url
        rest = url.partition("://")[2] or url
        host, slash, path = rest.partition("/")
        return format_html(
            '<span class="cut" title="{}">{}</span><span class="sub cut">{}</span>',
            url,
            host or url,
            slash + path,
        )

    @admin.display(description="event type")
    def event_type(self, d):
        # A long dotted name may break after its dots, never inside a word.
        return format_html_join(
            mark_safe("<wbr>"), "{}", ((p,) for p in re.split(r"(?<=\.)", d.event.event_type))
        )

    @admin.display(description="tries", ordering="attempt_count")
    def tries(self, d):
        return d.attempt_count

    @admin.display(description="next attempt", ordering="next_attempt_at")
    def next_attempt(self, d):
        if d.state != DeliveryState.PENDING:
            return EMPTY
        return when(d.next_attempt_at)

    @admin.display(description="last result")
    def last_result(self, d):
        return selectors.last_result(d) or EMPTY

    @admin.display(description="what happened")
    def last_answer(self, d):
        if not d.last_outcome:
            return "No attempt yet."
        if d.state == DeliveryState.DEAD:
            return dead_reason(d)
        if d.last_outcome == "success":
            return f"Delivered: the receiver answered HTTP {d.last_status_code}."
        answer = answer_of(d.last_status_code, d.last_error)
        return f"The last attempt got {answer}: {outcome_sentence(d.last_outcome)}."

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
        page's button alike (deliveries.core.confirm): a confirmation page first, and for
        a replay of any event type not marked replay-safe an extra confirmation. Returns
        None once done."""
        ids = list(queryset.values_list("id", flat=True)[:10_001])
        if len(ids) > 10_000:
            self.message_user(request, "Select at most 10,000 deliveries.", messages.ERROR)
            return None
        selection = self._selection(ids)
        service = services.delivery_replay if operation == "replay" else services.delivery_cancel
        return confirm_operation(
            self,
            request,
            DELIVERY_OPERATIONS[operation],
            selection,
            run=lambda ids: service(delivery_ids=ids, actor=request.user, via="admin"),
            back=back or reverse("admin:deliveries_delivery_changelist"),
        )

    @staticmethod
    def _selection(ids: list, **by_filter) -> Selection:
        """What the confirmation page shows of these deliveries: their event types, which
        are replay-safe and whose."""
        types = Counter(
            Delivery.objects.filter(id__in=ids).values_list("event__event_type", flat=True)
        )
        known = EventType.objects.filter(name__in=types)
        return Selection(
            ids=ids,
            types=types,
            safe=set(known.filter(replay_safe=True).values_list("name", flat=True)),
            owners=dict(known.values_list("name", "owner")),
            **by_filter,
        )

    def _refused(self, request, back: str):
        """None if the user may replay; else a redirect to ``back`` saying why not."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        if self.has_replay_permission(request):
            return None
        self.message_user(request, "You may view deliveries but not replay them.", messages.ERROR)
        return HttpResponseRedirect(back)

    def get_urls(self):
        return [
            path(
                "overview/",
                self.admin_site.admin_view(self.overview_view),
                name="deliveries_overview",
            ),
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
            path(
                "replay-matching/",
                self.admin_site.admin_view(self.replay_matching),
                name="deliveries_delivery_replay_matching",
            ),
            *super().get_urls(),
        ]

    def replay_one(self, request, delivery_id):
        """The delivery page's Replay button: the bulk action's confirmation, for one."""
        page = reverse("admin:deliveries_delivery_change", args=[delivery_id])
        if refused := self._refused(request, page):
            return refused
        if request.method != "POST":
            return HttpResponseRedirect(page)
        delivery = Delivery.objects.filter(id=delivery_id)
        return self._confirm(request, delivery, "replay", back=page) or HttpResponseRedirect(page)

    def replay_matching(self, request):
        """Replay every delivery the log shows under its current filters (the query
        string it was opened with), not only a selection: "every dead delivery of
        endpoint E that ended in the last 24 hours". The same confirmation as the action
        (count, event types, the replay-safe rule), at most REPLAY_MATCHING_MAX at a
        time. The confirming form carries the moment it was shown: rows that changed
        since (replayed by someone else, say) are left out."""
        log = reverse("admin:deliveries_delivery_changelist")
        query = request.GET.urlencode()
        back = f"{log}?{query}" if query else log
        if refused := self._refused(request, back):
            return refused
        try:
            changelist = self.get_changelist_instance(request)
        except IncorrectLookupParameters:
            return HttpResponseRedirect(f"{log}?e=1")
        described = [
            (spec.title, choice["display"])
            for spec in changelist.filter_specs
            for choice in spec.choices(changelist)
            if choice["selected"] and spec.used_parameters
        ]
        if changelist.query:
            described.append(("search", changelist.query))
        if not described:
            self.message_user(
                request,
                "Filter the log first: replaying everything is not offered.",
                messages.ERROR,
            )
            return HttpResponseRedirect(back)
        shown_at = (
            parse_datetime(request.POST.get("shown_at", "")) if request.method == "POST" else None
        )
        matching = changelist.get_queryset(request)
        if shown_at is not None:
            matching = matching.filter(updated_at__lte=shown_at)
        ids = list(matching.values_list("id", flat=True)[: REPLAY_MATCHING_MAX + 1])
        matched = len(ids)  # REPLAY_MATCHING_MAX + 1: more than one replay takes
        ids = ids[:REPLAY_MATCHING_MAX]
        selection = self._selection(
            ids,
            described=described,
            matched=matched,
            states=Counter(Delivery.objects.filter(id__in=ids).values_list("state", flat=True)),
            carried={"shown_at": (shown_at or timezone.now()).isoformat()},
        )
        if not ids:
            self.message_user(request, "No delivery matches these filters.", messages.WARNING)
            return HttpResponseRedirect(back)
        done = confirm_operation(
            self,
            request,
            DELIVERY_OPERATIONS["replay"],
            selection,
            run=lambda ids: services.delivery_replay(
                delivery_ids=ids, actor=request.user, via="admin, by filter"
            ),
            back=back,
        )
        return done or HttpResponseRedirect(back)

    def changelist_view(self, request, extra_context=None):
        query = request.GET.urlencode()
        extra = {
            "replay_matching_url": reverse("admin:deliveries_delivery_replay_matching")
            + (f"?{query}" if query else ""),
            "can_replay_matching": bool(query) and self.has_replay_permission(request),
            **(extra_context or {}),
        }
        return super().changelist_view(request, extra)

    def render_change_form(self, request, context, *args, **kwargs):
        context["has_replay_permission"] = self.has_replay_permission(request)
        return super().render_change_form(request, context, *args, **kwargs)

    def overview_view(self, request):
        """Is anything wrong, where, since when: the last 24 hours at a glance, worst
        endpoints first, each figure linking into the log it sums up
        (deliveries.overview)."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        return TemplateResponse(
            request,
            "admin/deliveries/overview.html",
            {
                **self.admin_site.each_context(request),
                **overview_context(),
                "title": "Overview",
                "opts": self.model._meta,
                "app_list": self.admin_site.get_app_list(request),
            },
        )

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
                "reason": outcome_label(g["last_outcome"]),
                "explanation": outcome_sentence(g["last_outcome"]),
                "latest_shown": when(g["latest"]),
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


def overview_context(now=None) -> dict:
    """What the overview page shows (its template: admin/deliveries/overview.html)."""
    now = now or timezone.now()
    log = reverse("admin:deliveries_delivery_changelist")
    minutes = overview.attempts_by_minute(now)
    charts = [
        {
            "name": name,
            "title": title,
            "total": minutes.total(name),
            "svg": charts_module.bar_chart(
                minutes.series[name],
                start=minutes.start,
                step=timedelta(minutes=1),
                title=f"{title}, attempts per minute",
                unit="per minute",
                bins=288,
                css_class=f"series-{name}",
                chart_id=f"chart-{name}",
            ),
            "by_hour": [sum(minutes.series[name][h * 60 : (h + 1) * 60]) for h in range(24)],
        }
        for name, title, _ in overview.SERIES
    ]
    attempts = sum(c["total"] for c in charts)
    delivered = minutes.total("delivered")
    dead = overview.dead_letters(now)
    queue = overview.queue(now)
    loops = overview.loops(now)
    required = required_loops()
    endpoints = overview.endpoint_health(now)
    hours = [dead.hours_start + timedelta(hours=h) for h in range(24)]
    return {
        "now": now,
        "charts": charts,
        "hours": [
            {"at": timezone.localtime(h), **{c["name"]: c["by_hour"][i] for c in charts}}
            for i, h in enumerate(minutes.start + timedelta(hours=k) for k in range(24))
        ],
        "attempts": attempts,
        "success_rate": delivered / attempts if attempts else None,
        "dead": dead,
        "dead_reasons": [
            {
                "label": outcome_label(outcome),
                "sentence": outcome_sentence(outcome),
                "count": n,
                "link": f"{log}?state=dead&last_outcome={outcome}",
            }
            for outcome, n in dead.by_reason
        ],
        "dead_chart": charts_module.bar_chart(
            dead.by_hour,
            start=dead.hours_start,
            step=timedelta(hours=1),
            title="Deliveries that went dead, per hour",
            unit="per hour",
            css_class="series-dead",
            chart_id="chart-dead",
        ),
        "dead_24h": sum(dead.by_hour),
        "dead_hours": list(zip(hours, dead.by_hour, strict=True)),
        "queue": queue,
        "oldest_due": duration(queue.oldest_due_seconds) if queue.oldest_due_seconds else "none",
        "relay_lag": duration(queue.relay_lag_seconds) if queue.relay_lag_seconds else "none",
        "loops": loops,
        "loops_down": [loop.kind for loop in loops if loop.kind in required and not loop.alive],
        "loops_required": required,
        "endpoints": [
            {
                "health": h,
                "log": f"{log}?endpoint={h.endpoint.id}",
                "dead_link": f"{log}?state=dead&endpoint={h.endpoint.id}",
                "page": reverse("admin:deliveries_endpoint_change", args=[h.endpoint.id]),
            }
            for h in endpoints
        ],
        "panels": console_panels(now),
        "log": log,
    }


def required_loops() -> tuple[str, ...]:
    """The loops the outbound pipeline needs; the others (poll, jobs) run where they are
    used. The relay only with a broker outside the database: the database broker's
    workers take the outbox themselves."""
    if takes_outbox(broker_class()):
        return ("scheduler", "workers")
    return ("scheduler", "relay", "workers")


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
class EndpointAdmin(AuditedEdits, ConsoleAdmin, admin.ModelAdmin):
    list_display = [
        "url",
        "tenant",
        "status",
        "success_rate_24h",
        "latency_24h",
        "failing_since",
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
        # Health over the last 24 h for the endpoints on this page only, from the tallies
        # the overview reads too (deliveries.overview): one query.
        endpoints = changelist.result_list
        tallies = overview.endpoint_tallies(timezone.now(), [e.id for e in endpoints])
        for endpoint in endpoints:
            endpoint.health = overview.health_of(endpoint, tallies)
        return changelist

    @admin.display(description="status")
    def status(self, endpoint):
        """Disabled, paused or running, with since when and why."""
        if not endpoint.enabled:
            return format_html(
                "{}<span class='sub'>{}</span><span class='sub'>since {}</span>",
                state_badge("disabled"),
                endpoint.disabled_reason or "no reason given",
                when(endpoint.disabled_at),
            )
        if endpoint.paused_at is not None:
            return format_html(
                "{}<span class='sub'>{}: its deliveries are held</span>"
                "<span class='sub'>since {}</span>",
                state_badge("paused"),
                endpoint.paused_reason or "paused",
                when(endpoint.paused_at),
            )
        if endpoint.failing_since is not None:
            return state_badge("failing")
        return state_badge("running")

    @admin.display(description="delivered 24 h")
    def success_rate_24h(self, endpoint):
        h = getattr(endpoint, "health", None)
        if h is None or not h.attempts:
            return EMPTY
        return f"{100 * h.success_rate:.1f}% of {h.attempts:,}"

    @admin.display(description="p50 / p95 24 h")
    def latency_24h(self, endpoint):
        h = getattr(endpoint, "health", None)
        if h is None or not h.attempts:
            return EMPTY
        return f"{h.p50} / {h.p95}"

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
class TenantAdmin(AuditedEdits, ConsoleAdmin, admin.ModelAdmin):
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
class EgressAllowanceAdmin(AuditedEdits, ConsoleAdmin, admin.ModelAdmin):
    """Networks opened for one tenant (or endpoint) past the egress guard. Adding,
    changing and deleting need their own model permissions, and each is audited by its
    service (egress_allowance_save, egress_allowances_delete)."""

    audited_by_services = True

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
    audited_by_services = True  # the expiry, the one edit, through api_key_set_expiry

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
class EventTypeAdmin(AuditedEdits, ConsoleAdmin, admin.ModelAdmin):
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


class _TaskRows:
    # A task's arguments and result are pickled Python values: shown as key: value lines.
    display_overrides = {"args": key_values, "kwargs": key_values, "result": key_values}

    # django-q2's task admins read ``obj._meta`` for their read-only fields, which the
    # console's rendering asks for without a row too.
    def get_readonly_fields(self, request, obj=None):
        return super().get_readonly_fields(request, obj) if obj is not None else []


class SuccessAdmin(AuditedEdits, _TaskRows, ConsoleAdmin, q_admin.TaskAdmin):
    actions = [resubmit_tasks]

    def has_resubmit_permission(self, request):
        return self.has_change_permission(request)

    @admin.display(description="time taken")
    def time_taken(self, task):
        return duration(task.time_taken())


class FailureAdmin(AuditedEdits, _TaskRows, ConsoleAdmin, q_admin.FailAdmin):
    actions = [resubmit_tasks]

    def has_resubmit_permission(self, request):
        return self.has_change_permission(request) and self.has_delete_permission(request)


class ScheduleAdmin(AuditedEdits, ConsoleAdmin, q_admin.ScheduleAdmin):
    """django-q2's schedules, edited in the console like any row: audited."""


class QueueAdmin(AuditedEdits, ConsoleAdmin, q_admin.QueueAdmin):
    pass


for _model, _model_admin in [
    (Success, SuccessAdmin),
    (Failure, FailureAdmin),
    (Schedule, ScheduleAdmin),
    (OrmQ, QueueAdmin),
]:
    if admin.site.is_registered(_model):  # OrmQ only with django-q2's ORM broker
        admin.site.unregister(_model)
        admin.site.register(_model, _model_admin)
