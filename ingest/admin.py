"""Staff views of inbound webhooks: sources, events (with reprocess), refusals."""

from django import forms
from django.contrib import admin, messages
from django.utils.html import format_html, format_html_join

from deliveries.admin import CappedCountPaginator, ReadOnlyAdmin
from deliveries.jobs.console import ConsoleAdmin

from . import processing
from .models import BackfillRun, HandlerRun, InboundEvent, PollSource, Source, VerificationFailure
from .selectors import backfill_progress, body_shown, headers_shown


@admin.register(Source)
class SourceAdmin(ConsoleAdmin, admin.ModelAdmin):
    list_display = ["slug", "scheme", "enabled", "replay_tolerance", "max_body_bytes", "rate_limit"]
    list_filter = ["scheme", "enabled"]
    search_fields = ["slug"]
    fields = [
        "slug",
        "scheme",
        "options",
        "enabled",
        "replay_tolerance",
        "max_body_bytes",
        "content_types",
        "rate_limit",
        "redact_keys",
    ]


class HandlerRunInline(ConsoleAdmin, admin.TabularInline):
    model = HandlerRun
    classes = ["console-timeline"]
    fields = ["attempt", "handler", "started_at", "duration_ms", "outcome", "error"]
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(InboundEvent)
class InboundEventAdmin(ReadOnlyAdmin):
    list_display = [
        "event_id",
        "source",
        "event_type",
        "state",
        "duplicates",
        "attempt_count",
        "received_at",
        "processed_at",
    ]
    list_filter = ["state", "source"]
    search_fields = ["=event_id", "=entity_id"]
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    paginator = CappedCountPaginator
    ordering = ["-received_at"]
    inlines = [HandlerRunInline]
    actions = ["reprocess"]
    fields = [
        "id",
        "source",
        "event_id",
        "event_type",
        "entity_id",
        "state",
        "occurred_at",
        "received_at",
        "duplicates",
        "last_duplicate_at",
        "attempt_count",
        "next_attempt_at",
        "processed_at",
        "last_error",
        "headers_received",
        "body_received",
    ]
    readonly_fields = fields

    @admin.display(description="headers")
    def headers_received(self, event):
        """As stored (signatures and credentials never are), the redacted names masked."""
        shown = headers_shown(event, event.source)
        if not shown:
            return "none stored"
        return format_html_join("", "<div><code>{}: {}</code></div>", shown.items())

    @admin.display(description="body")
    def body_received(self, event):
        """As received, the source's redacted keys masked (ingest.selectors.body_shown)."""
        shown = body_shown(event, event.source)
        if not shown.text:
            return shown.note
        return format_html(
            '<div class="quiet">{}</div><pre class="body">{}</pre>', shown.note, shown.text
        )

    @admin.action(description="Process again (audited)", permissions=["change"])
    def reprocess(self, request, queryset):
        n = processing.inbound_reprocess(
            event_ids=list(queryset.values_list("id", flat=True)), actor=request.user
        )
        self.message_user(request, f"{n} events queued for processing again.", messages.SUCCESS)

    def has_change_permission(self, request, obj=None):
        # Only for the reprocess action: every field stays read-only.
        return obj is None and request.user.has_perm("ingest.change_inboundevent")


@admin.register(VerificationFailure)
class VerificationFailureAdmin(ReadOnlyAdmin):
    list_display = ["source", "reason", "count", "first_at", "last_at", "sample"]
    list_filter = ["reason", "source"]


class PollSourceForm(forms.ModelForm):
    # Write-only: the page never shows the secret; left blank, the stored one stays.
    auth_secret = forms.CharField(
        required=False,
        widget=forms.PasswordInput(render_value=False),
        help_text="The auth header's value. Leave blank to keep the current one.",
    )

    class Meta:
        model = PollSource
        fields = ["tenant", "adapter", "config", "auth_secret", "enabled", "every_minutes"]

    def _post_clean(self):
        super()._post_clean()
        # Not a model field: the model's auth_secret property encrypts what it is given.
        if self.cleaned_data.get("auth_secret"):
            self.instance.auth_secret = self.cleaned_data["auth_secret"]

    def clean_config(self):
        from .changes import http_json_config

        try:
            http_json_config(self.cleaned_data["config"] or {})
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from exc
        return self.cleaned_data["config"]


@admin.register(PollSource)
class PollSourceAdmin(ConsoleAdmin, admin.ModelAdmin):
    form = PollSourceForm
    list_display = ["__str__", "tenant", "enabled", "every_minutes", "cursor_at", "last_poll_at"]
    list_filter = ["enabled"]
    readonly_fields = [
        "cursor_at",
        "last_poll_at",
        "last_poll_counts",
        "last_error",
        "auth_secret_set",
    ]

    def has_add_permission(self, request):
        return False  # created with its inbound source by ingest.poll_sources.poll_source_create

    def get_fields(self, request, obj=None):
        fields = super().get_fields(request, obj)  # the form's, then auth_secret_set
        if self.has_change_permission(request, obj):
            return fields
        # Read-only, the page would print the stored secret: say only whether there is one.
        return [f for f in fields if f != "auth_secret"]

    @admin.display(description="auth secret")
    def auth_secret_set(self, poll_source):
        return "set (hidden)" if poll_source.auth_secret else "not set"


def _eta(seconds):
    if seconds is None:
        return "-"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


@admin.register(BackfillRun)
class BackfillRunAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "source",
        "state",
        "progress",
        "processed_count",
        "rates",
        "checkpoint_at",
        "eta",
        "started_by",
        "created_at",
    ]
    list_filter = ["state", "source"]
    ordering = ["-created_at"]
    list_select_related = ["source__source"]
    readonly_fields = [
        "source",
        "state",
        "progress",
        "eta",
        "rates",
        "since",
        "until",
        "rate",
        "page_size",
        "started_by",
        "created_at",
        "heartbeat_at",
        "finished_at",
        "checkpoint_at",
        "processed",
        "stored",
        "duplicates",
        "pages",
        "requests",
        "total",
        "resumes",
        "active_seconds",
        "error",
    ]
    exclude = ["checkpoint_ids"]

    def has_view_permission(self, request, obj=None):
        return request.user.is_staff and super().has_view_permission(request, obj)

    @admin.display(description="progress")
    def progress(self, run):
        return f"{backfill_progress(run).fraction:.0%}"

    @admin.display(description="processed", ordering="processed")
    def processed_count(self, run):
        return f"{run.processed:,}"

    @admin.display(description="rate (records/s, requests/s)")
    def rates(self, run):
        p = backfill_progress(run)
        return f"{p.records_per_second:,.0f} rec/s, {p.requests_per_second:.2f} req/s"

    @admin.display(description="ETA")
    def eta(self, run):
        return _eta(backfill_progress(run).eta_seconds)
