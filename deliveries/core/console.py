"""How the operator's console shows values, for every admin of the products (the
deliveries, inbound and background jobs admins use it alike).

One rule per kind of value, applied by ``ConsoleAdmin`` to every field an admin shows
(list columns and read-only fields, its inlines' too), so that no page falls back to
Django's defaults:

- a time: with seconds and the zone, and beside it how long ago (or how soon) it is
  (``when``), in a ``<time>`` element that carries the exact instant;
- a duration: milliseconds or seconds with sensible precision (``duration``);
- a JSON value: keys and values as a list, not a dump (``key_values``);
- a long id: its first characters, the whole of it in the title and the link
  (``short_id``).

What a product adds (outcomes read as sentences, state badges) stays in its own admin;
``display_overrides`` lets an admin name its own rendering for a field.
"""

import json
import math
import re
from collections.abc import Callable, Iterable
from datetime import datetime

from django.contrib import admin
from django.core.exceptions import FieldDoesNotExist
from django.core.paginator import Paginator
from django.db import OperationalError, connection, models, transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.functional import cached_property
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from .audit import audit

EMPTY = "—"


# --- Times ---------------------------------------------------------------------------


def ago(moment: datetime, now: datetime | None = None) -> str:
    """``3 min ago``, ``in 12 s``, ``2 h 5 min ago``, ``4 days ago``: coarse, for reading
    at a glance (the exact instant is beside it)."""
    now = now or timezone.now()
    seconds = (now - moment).total_seconds()
    future = seconds < 0
    seconds = abs(seconds)
    if seconds < 1:
        return "just now"
    if seconds < 60:
        text = f"{seconds:.0f} s"
    elif seconds < 3600:
        text = f"{seconds // 60:.0f} min"
    elif seconds < 86_400:
        hours, rest = divmod(seconds, 3600)
        text = f"{hours:.0f} h" + (f" {rest // 60:.0f} min" if rest >= 60 and hours < 10 else "")
    else:
        days = seconds / 86_400
        text = f"{days:.0f} day" + ("s" if round(days) != 1 else "")
    return f"in {text}" if future else f"{text} ago"


def timestamp(moment: datetime) -> str:
    """``2026-12-05 13:08:07 UTC``: seconds and the zone, in the current time zone."""
    local = timezone.localtime(moment)
    return f"{local:%Y-%m-%d %H:%M:%S} {local.tzname() or local.strftime('%z')}"


def when(moment: datetime | None, *, now: datetime | None = None) -> SafeString | str:
    """A time as the console shows it: ``2026-12-05 13:08:07 UTC`` and ``3 min ago``."""
    if moment is None:
        return EMPTY
    return format_html(
        '<time class="when" datetime="{}" title="{}">{}</time> <span class="ago">{}</span>',
        moment.isoformat(),
        moment.isoformat(),
        timestamp(moment),
        ago(moment, now),
    )


# --- Durations and numbers -----------------------------------------------------------


def duration(seconds: float | None) -> str:
    """``6.5 ms``, ``312 ms``, ``2.0 s``, ``48 s``, ``3 min 20 s``, ``5 h 12 min``."""
    if seconds is None or not math.isfinite(seconds):
        return EMPTY
    seconds = max(seconds, 0.0)
    if seconds < 0.01:
        return f"{seconds * 1000:.1f} ms"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        minutes, rest = divmod(round(seconds), 60)
        return f"{minutes} min {rest} s" if rest else f"{minutes} min"
    hours, rest = divmod(round(seconds), 3600)
    if hours < 48:
        return f"{hours} h {rest // 60} min" if rest >= 60 else f"{hours} h"
    return f"{hours // 24} days {hours % 24} h"


def duration_ms(milliseconds: float | None) -> str:
    return EMPTY if milliseconds is None else duration(milliseconds / 1000)


# --- Structured values ---------------------------------------------------------------


def _scalar(value) -> str:
    if value is None:
        return EMPTY
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)[:200]
    text = str(value)
    if len(text) >= 19 and text[4:5] == "-" and text[10:11] in "T ":
        moment = parse_datetime(text)  # an ISO time in a JSON value: shown as a time
        if moment is not None and moment.tzinfo is not None:
            return timestamp(moment)
    return text


def key_values(value, *, limit: int = 50) -> SafeString | str:
    """A JSON object as ``key: value`` lines (a list as its items, comma separated); a
    value nested deeper is shown compactly. Empty: the dash."""
    if value in (None, {}, [], ""):
        return EMPTY
    if isinstance(value, list):
        return ", ".join(_scalar(v) for v in value[:limit]) + (" …" if len(value) > limit else "")
    if not isinstance(value, dict):
        return _scalar(value)
    items = list(value.items())
    shown = format_html_join(
        "",
        '<div class="kv"><span class="k">{}</span> {}</div>',
        ((str(k).replace("_", " ") + ":", _scalar(v)) for k, v in items[:limit]),
    )
    more = f'<div class="kv">… and {len(items) - limit} more</div>' if len(items) > limit else ""
    return mark_safe(shown + more)  # noqa: S308 (built by format_html_join)


def short_id(value, *, head: int = 8, tail: int = 4) -> SafeString | str:
    """A long id as its first and last characters (a time-ordered id shares its first
    ones with its neighbours; its last ones are random): ``0193a5b2…c2f1``. The whole id
    is in the title, and a copy of the text takes the whole id (the middle is in the page,
    drawn at no width)."""
    if value is None:
        return EMPTY
    text = str(value)
    if len(text) <= head + tail + 2:
        return text
    return format_html(
        '<span class="short-id" title="{}">{}<span class="mid">{}</span>'
        '<span class="dots" aria-hidden="true">…</span>{}</span>',
        text,
        text[:head],
        text[head:-tail],
        text[-tail:],
    )


# --- The admin mixin -----------------------------------------------------------------


def _field(model, name: str):
    try:
        return model._meta.get_field(name)
    except FieldDoesNotExist:  # the admin's own column
        return None


def _column(model, name: str, render: Callable) -> Callable:
    """A list column / read-only field named ``name`` that shows the model field ``name``
    through ``render``: the same CSS class and header, sortable by the field."""
    field = model._meta.get_field(name)

    def show(obj):
        return render(getattr(obj, name))

    show.__name__ = name
    # "duration ms" reads "duration": the value carries its unit.
    show.short_description = re.sub(r" (ms|seconds)$", "", str(field.verbose_name))
    show.admin_order_field = name
    return show


def renderer_for(field) -> Callable | None:
    """The console's rendering of a model field, or None for Django's own."""
    if isinstance(field, models.DateTimeField):
        return when
    if isinstance(field, models.FloatField) and field.name.endswith("_ms"):
        return duration_ms
    if isinstance(field, models.FloatField) and field.name.endswith("_seconds"):
        return duration
    if isinstance(field, models.JSONField):
        return key_values
    if isinstance(field, models.UUIDField):
        return short_id
    return None


class ConsoleAdmin:
    """Mixin for a ModelAdmin or an inline: its list columns and read-only fields that
    name a time, a duration, a JSON value or a UUID are shown by the console's rule for
    it (``renderer_for``), or by ``display_overrides`` (field name → function of the
    value). Editable fields are left to their form widgets."""

    display_overrides: dict[str, Callable] = {}

    def _console_column(self, name):
        if not isinstance(name, str):
            return name
        # The same function for a name on every call: Django matches read-only fields
        # by identity when it lays out a form.
        cache = self.__dict__.setdefault("_console_columns", {})
        if name not in cache:
            field = _field(self.model, name)
            render = self.display_overrides.get(name) or (field and renderer_for(field))
            cache[name] = _column(self.model, name, render) if field and render else name
        return cache[name]

    def _shown(self, names: Iterable, readonly: set | None = None) -> list:
        """``names`` with the console's columns in place of the fields it renders: all of
        them (``readonly`` None), or those in ``readonly``."""
        return [self._console_column(n) if readonly is None or n in readonly else n for n in names]

    def get_list_display(self, request):
        return self._shown(super().get_list_display(request))

    def get_readonly_fields(self, request, obj=None):
        return self._shown(super().get_readonly_fields(request, obj))

    def _readonly_names(self, request, obj) -> set | None:
        """The fields shown read-only (None: all of them, to a user who may not change
        the row, for whom Django shows every field read-only)."""
        if obj is not None and not self.has_change_permission(request, obj):
            return None
        return {n for n in super().get_readonly_fields(request, obj) if isinstance(n, str)}

    def get_fields(self, request, obj=None):
        return self._shown(super().get_fields(request, obj), self._readonly_names(request, obj))

    def get_fieldsets(self, request, obj=None):
        fieldsets = super().get_fieldsets(request, obj)
        if not self.fieldsets:  # made from get_fields: mapped already
            return fieldsets
        readonly = self._readonly_names(request, obj)
        return [
            (title, {**options, "fields": self._shown(options["fields"], readonly)})
            for title, options in fieldsets
        ]

    class Media:
        css = {"all": ["trusty_jobs/console.css"]}


# --- Edits made on the admin's own pages -----------------------------------------------


def _changed_fields(message) -> list[str]:
    """The field names of a change message (Django's JSON list of {"changed": {"fields"}}),
    never their values: a value may be a secret."""
    try:
        entries = json.loads(message) if isinstance(message, str) else message
    except ValueError:
        return []
    fields: list[str] = []
    for entry in entries or []:
        if isinstance(entry, dict):
            for change in entry.values():
                if isinstance(change, dict):
                    fields.extend(str(f) for f in change.get("fields", []))
    return fields


class AuditedEdits:
    """Mixin for a ModelAdmin: what staff add, change or delete on its own pages (the add
    and change forms, a list's editable columns, the delete page and the "delete selected"
    action) is written to the audit log like an action is, with the user, the rows and
    the names of the fields changed (never their values), in the transaction that makes
    the change.

    An admin whose saves go through a service that audits them already sets
    ``audited_by_services = True``."""

    audited_by_services = False

    def _audit_edit(self, request, verb: str, objects: list, count: int = 1, **details) -> None:
        if self.audited_by_services:
            return
        opts = self.model._meta
        audit(
            actor=request.user,
            action=f"{opts.app_label}.{opts.model_name}.{verb}",
            target=opts.model_name,
            count=count,
            via="admin",
            objects=[{"id": str(o.pk), "name": str(o)[:200]} for o in objects[:100]],
            **details,
        )

    def log_addition(self, request, obj, message):
        entry = super().log_addition(request, obj, message)
        self._audit_edit(request, "add", [obj])
        return entry

    def log_change(self, request, obj, message):
        entry = super().log_change(request, obj, message)
        self._audit_edit(request, "change", [obj], fields=_changed_fields(message))
        return entry

    def delete_model(self, request, obj):
        with transaction.atomic(using=self.model._default_manager.db):
            self._audit_edit(request, "delete", [obj])
            super().delete_model(request, obj)

    def delete_queryset(self, request, queryset):
        with transaction.atomic(using=queryset.db):
            self._audit_edit(request, "delete", list(queryset[:100]), count=queryset.count())
            super().delete_queryset(request, queryset)


# --- Shared admin pieces ------------------------------------------------------------

# The colour of a state's badge, whichever product's state it is; grey for the rest.
STATE_COLOURS = {
    "pending": "#b7791f",
    "enqueued": "#2b6cb0",
    "leased": "#6b46c1",
    "succeeded": "#2f855a",
    "dead": "#c53030",
    "held": "#4a5568",
    "running": "#2f855a",
    "paused": "#b7791f",
    "failing": "#c05621",
    "disabled": "#c53030",
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


class ReadOnlyAdmin(AuditedEdits, ConsoleAdmin, admin.ModelAdmin):
    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


# --- The overview's panels -----------------------------------------------------------

Panel = Callable[[datetime], dict]
PANELS: dict[str, Panel] = {}


def register_panel(name: str, panel: Panel) -> None:
    """``panel(now) -> {"title", "template", ...}``: a section of the overview, rendered
    with its template and the dict as context. Apps register from AppConfig.ready (ingest:
    inbound receipts and refusals)."""
    PANELS[name] = panel


def panels(now: datetime) -> list[dict]:
    return [panel(now) for panel in PANELS.values()]
