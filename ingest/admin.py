"""Staff views of inbound webhooks: sources, events (with reprocess), inbound emails
(with reprocess), refusals."""

import re

from django import forms
from django.contrib import admin, messages
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from deliveries.core.console import (
    AuditedEdits,
    CappedCountPaginator,
    ConsoleAdmin,
    ReadOnlyAdmin,
    state_badge,
)

from . import mail, state
from .backfill import (
    BackfillError,
    backfill_options_check,
    backfill_run_create,
    backfill_run_start,
)
from .changes import http_json_config
from .models import (
    BackfillRun,
    HandlerRun,
    InboundEmail,
    InboundEvent,
    PollSource,
    Source,
    VerificationFailure,
)
from .poll_sources import poll_source_create, poll_source_poll_now
from .selectors import backfill_progress, body_shown, headers_shown


@admin.register(Source)
class SourceAdmin(AuditedEdits, ConsoleAdmin, admin.ModelAdmin):
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
        n = state.inbound_reprocess(
            event_ids=list(queryset.values_list("id", flat=True)), actor=request.user
        )
        self.message_user(request, f"{n} events queued for processing again.", messages.SUCCESS)

    def has_change_permission(self, request, obj=None):
        # Only for the reprocess action: every field stays read-only.
        return obj is None and request.user.has_perm("ingest.change_inboundevent")


@admin.register(InboundEmail)
class InboundEmailAdmin(ReadOnlyAdmin):
    """Mail received by the SMTP listener and the providers' posts: one row per
    accepted recipient, newest first (index inbound_email_received)."""

    list_display = [
        "received_at",
        "subject_line",
        "mail_from",
        "recipient",
        "badge",
        "transport",
        "rejected_reason",
    ]
    list_filter = ["transport", "event__state", "event__source"]
    search_fields = ["=message_id", "=mail_from", "=recipient"]
    list_select_related = ["event__source"]
    show_full_result_count = False
    paginator = CappedCountPaginator
    ordering = ["-received_at"]
    actions = ["reprocess"]
    fields = [
        "source",
        "badge",
        "received_at",
        "transport",
        "remote_addr",
        "tls",
        "authenticated_as",
        "mail_from",
        "recipient",
        "recipients",
        "from_address",
        "to",
        "cc",
        "subject",
        "sent_at",
        "message_id",
        "size",
        "rejected_reason",
        "authentication",
        "attachments",
        "handler_runs",
        "body_text",
        "raw_headers",
    ]
    readonly_fields = fields

    def has_reprocess_permission(self, request):
        return request.user.has_perm("ingest.reprocess_inboundemail")

    @admin.action(description="Process again (audited)", permissions=["reprocess"])
    def reprocess(self, request, queryset):
        n = state.inbound_reprocess(
            event_ids=list(queryset.values_list("event_id", flat=True)),
            actor=request.user,
            action="inbound_email.reprocess",
            target="inbound_email",
        )
        self.message_user(request, f"{n} emails queued for processing again.", messages.SUCCESS)

    @admin.display(description="subject", ordering="subject")
    def subject_line(self, email):
        return email.subject[:80] or "(no subject)"

    @admin.display(description="state")
    def badge(self, email):
        return state_badge(email.event.state)

    @admin.display(description="source")
    def source(self, email):
        return email.event.source.slug

    @admin.display(description="handler runs")
    def handler_runs(self, email):
        runs = email.event.runs.order_by("id")[:50]
        if not runs:
            return "none yet"
        return format_html_join(
            "",
            "<div><code>#{} {} {} {} ms {}</code></div>",
            (
                (r.attempt, r.handler or "-", r.outcome, round(r.duration_ms, 1), r.error[:300])
                for r in runs
            ),
        )

    @admin.display(description="message (text)")
    def body_text(self, email):
        if email.rejected_reason:
            return "not shown: the message was rejected"
        content = mail.read(bytes(email.event.body))
        text = content.text or content.html
        return format_html("<pre style='white-space:pre-wrap'>{}</pre>", text[:20_000])

    @admin.display(description="headers")
    def raw_headers(self, email):
        # The header block ends at the first empty line, CRLF or (a provider's post) LF.
        head = re.split(rb"\r?\n\r?\n", bytes(email.event.body), maxsplit=1)[0][:20_000]
        lines = head.decode("utf-8", "replace").splitlines()
        return format_html(
            "<pre style='white-space:pre-wrap'>{}</pre>",
            "\n".join(mail.clean(line) for line in lines),
        )


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

        try:
            http_json_config(self.cleaned_data["config"] or {})
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from exc
        return self.cleaned_data["config"]


class PollSourceAddForm(PollSourceForm):
    """A new poll source: its slug (its inbound source's, made with it) and whether to
    poll it on a schedule; saved by ingest.poll_sources.poll_source_create."""

    slug = forms.SlugField(max_length=100, help_text="Its inbound source's name, in URLs.")
    schedule = forms.BooleanField(
        required=False,
        initial=True,
        help_text="Poll it every few minutes (a django-q2 schedule); off, only when asked.",
    )

    class Meta(PollSourceForm.Meta):
        fields = ["slug", "tenant", "config", "auth_secret", "every_minutes", "schedule"]

    def clean_slug(self):
        slug = self.cleaned_data["slug"]
        if Source.objects.filter(slug=slug).exists():
            raise forms.ValidationError("A source with this slug exists already.")
        return slug


def _copy_saved(into, saved) -> None:
    """The row a service saved, into the object the admin holds (for its log and
    redirect): the admin's own form built that object but did not save it."""
    for field in saved._meta.concrete_fields:
        setattr(into, field.attname, getattr(saved, field.attname))
    into._state.adding = False
    into._state.db = saved._state.db


@admin.register(PollSource)
class PollSourceAdmin(AuditedEdits, ConsoleAdmin, admin.ModelAdmin):
    form = PollSourceForm
    add_form = PollSourceAddForm
    actions = ["poll_now"]
    list_display = ["__str__", "tenant", "enabled", "every_minutes", "cursor_at", "last_poll_at"]
    list_filter = ["enabled"]
    readonly_fields = [
        "cursor_at",
        "last_poll_at",
        "last_poll_counts",
        "last_error",
        "auth_secret_set",
    ]

    def get_form(self, request, obj=None, **kwargs):
        if obj is None:
            kwargs["form"] = self.add_form
        return super().get_form(request, obj, **kwargs)

    def get_readonly_fields(self, request, obj=None):
        return super().get_readonly_fields(request, obj) if obj is not None else []

    def save_model(self, request, obj, form, change):
        if change:
            return super().save_model(request, obj, form, change)
        data = form.cleaned_data
        poll = poll_source_create(
            slug=data["slug"],
            config=data["config"],
            auth_secret=data.get("auth_secret") or "",
            tenant=data.get("tenant"),
            every_minutes=data["every_minutes"],
            schedule=data.get("schedule", False),
        )
        _copy_saved(obj, poll)

    def has_poll_permission(self, request):
        return request.user.has_perm("ingest.poll_pollsource")

    @admin.action(description="Poll now (run_jobs polls it)", permissions=["poll"])
    def poll_now(self, request, queryset):
        for poll in queryset.select_related("source"):
            poll_source_poll_now(poll=poll, actor=request.user)
        self.message_user(
            request,
            f"{queryset.count()} polls queued: run_jobs runs them in the background.",
            messages.SUCCESS,
        )

    def get_fields(self, request, obj=None):
        if obj is None:
            return list(self.add_form.Meta.fields)
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


class BackfillRunAddForm(forms.ModelForm):
    """A new backfill of a poll source's window; saved by backfill_run_create, started by
    backfill_run_start (a background job: the request never runs it)."""

    until = forms.DateTimeField(required=False, help_text="Exclusive; empty: now.")
    page_size = forms.IntegerField(
        required=False, min_value=1, max_value=100_000, help_text="Empty: the source's own."
    )
    start_now = forms.BooleanField(
        required=False, initial=True, help_text="Start it at once (run_jobs runs it)."
    )

    class Meta:
        model = BackfillRun
        fields = ["source", "since", "until", "rate", "page_size"]

    def clean(self):
        data = super().clean()
        if data.get("since") and data.get("rate") is not None:
            try:
                backfill_options_check(
                    since=data["since"],
                    until=data.get("until") or timezone.now(),
                    rate=data["rate"],
                    page_size=data.get("page_size"),
                )
            except BackfillError as exc:
                raise forms.ValidationError(str(exc).replace("--", "")) from exc
        return data


@admin.register(BackfillRun)
class BackfillRunAdmin(ReadOnlyAdmin):
    add_form = BackfillRunAddForm
    actions = ["start"]
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

    def has_add_permission(self, request):
        return request.user.has_perm("ingest.add_backfillrun")

    def has_start_permission(self, request):
        return request.user.has_perm("ingest.start_backfillrun")

    def get_form(self, request, obj=None, **kwargs):
        if obj is None:
            kwargs["form"] = self.add_form
            kwargs["fields"] = [*self.add_form.Meta.fields, "start_now"]
        return super().get_form(request, obj, **kwargs)

    def get_readonly_fields(self, request, obj=None):
        return super().get_readonly_fields(request, obj) if obj is not None else []

    def get_fields(self, request, obj=None):
        if obj is None:
            return [*self.add_form.Meta.fields, "start_now"]
        return super().get_fields(request, obj)

    def save_model(self, request, obj, form, change):
        data = form.cleaned_data
        run = backfill_run_create(
            slug=data["source"].source.slug,
            since=data["since"],
            until=data.get("until"),
            rate=data["rate"],
            page_size=data.get("page_size"),
            started_by=f"{request.user.get_username()} (console)",
        )
        _copy_saved(obj, run)
        if data.get("start_now"):
            if self.has_start_permission(request):
                backfill_run_start(run_id=run.id, actor=request.user)
            else:
                self.message_user(
                    request,
                    "Created, not started: starting needs its own permission.",
                    messages.WARNING,
                )

    @admin.action(
        description="Start or resume selected runs (run_jobs runs them)", permissions=["start"]
    )
    def start(self, request, queryset):
        started, refused = 0, []
        for run in queryset:
            try:
                backfill_run_start(run_id=run.id, actor=request.user)
                started += 1
            except BackfillError as exc:
                refused.append(str(exc))
        self.message_user(
            request,
            f"{started} backfills queued: run_jobs runs them in the background.",
            messages.SUCCESS,
        )
        for reason in refused:
            self.message_user(request, reason, messages.WARNING)

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
