"""The background jobs in the operator's console: the jobs (read-only, with their runs
and progress), the dead jobs grouped by type and reason, the actions replay and cancel
(each behind its own permission, ``trusty_jobs.replay_job`` and ``cancel_job``, each
calling a service that writes an audit row in the same transaction), and the recurring
jobs, edited through their service. Listed in docs/operations.md, "Admin permissions"."""

import uuid
from collections import Counter

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Max
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html

from ..core.confirm import Operation, Selection, confirm_operation
from ..core.console import AuditedEdits, ConsoleAdmin
from . import services
from .background.registry import JOB_TYPES
from .models import Job, JobRun, JobState, RecurringJob
from .selectors import job_progress

MAX_SELECTED = 10_000
JOB_OPERATIONS = {
    "replay": Operation(
        name="replay",
        noun=("job", "jobs"),
        type_label="job type",
        explanation="Each dead job goes back to <em>pending</em>, due now, with the "
        "<strong>same id</strong> and a fresh budget of attempts (its deadline cleared); "
        "its earlier runs stay. Jobs that are not dead are left alone.",
        done="returned to pending",
        unsafe_warning="Some of these job types are not marked replay-safe: running one "
        "again may repeat a side effect its function does not guard against.",
    ),
    "cancel": Operation(
        name="cancel",
        noun=("job", "jobs"),
        type_label="job type",
        explanation="Pending jobs become <em>dead</em> (cancelled by an operator). A running "
        "job cannot be recalled.",
        done="cancelled",
    ),
}


def uuid_or_none(value):
    """A list filter's or a search's value as a UUID, or None when it is none."""
    try:
        return uuid.UUID(str(value)) if value else None
    except ValueError:
        return None


class JobTypeFilter(admin.SimpleListFilter):
    """The types registered in this process (no scan of the table for its values)."""

    title = "type"
    parameter_name = "type"

    def lookups(self, request, model_admin):
        return [(name, name) for name in sorted(JOB_TYPES)]

    def queryset(self, request, queryset):
        return queryset.filter(type=self.value()) if self.value() else queryset


class QueueFilter(admin.SimpleListFilter):
    title = "queue"
    parameter_name = "queue"

    def lookups(self, request, model_admin):
        return [(q, q) for q in sorted({t.queue for t in JOB_TYPES.values()} | {"default"})]

    def queryset(self, request, queryset):
        return queryset.filter(queue=self.value()) if self.value() else queryset


class TenantFilter(admin.SimpleListFilter):
    """The first 200 tenants by name, from the app that owns them (the deliveries app
    registers them: ``services.register_tenant_choices``); ``field`` is the lookup."""

    title = "tenant"
    parameter_name = "tenant"
    field = "tenant_id"

    def lookups(self, request, model_admin):
        return services.tenant_choices()

    def queryset(self, request, queryset):
        value = uuid_or_none(self.value())
        return queryset.filter(**{self.field: value}) if value else queryset


class ReadOnlyInline(ConsoleAdmin, admin.TabularInline):
    extra = 0
    can_delete = False
    classes = ["console-timeline"]

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class JobRunInline(ReadOnlyInline):
    model = JobRun
    fields = ["attempt", "started_at", "duration_ms", "outcome", "run_id", "traceback"]
    readonly_fields = fields
    ordering = ["started_at", "id"]
    verbose_name_plural = "runs"

    @admin.display(description="traceback (secrets masked when stored)")
    def traceback(self, run):
        return format_html("<pre style='max-height:20em;overflow:auto'>{}</pre>", run.error)


def _progress_text(job: Job) -> str:
    p = job_progress(job)
    if p.done is None:
        return "—"
    text = f"{p.done:,}" + (f" of {p.total:,}" if p.total else "")
    if p.rate is not None:
        text += f", {p.rate:,.1f}/s"
    if p.eta_seconds is not None:
        text += f", about {p.eta_seconds:,.0f} s left"
    return text


@admin.register(Job)
class JobAdmin(AuditedEdits, ConsoleAdmin, admin.ModelAdmin):
    list_display = [
        "id",
        "type",
        "state",
        "queue",
        "tenant_id",
        "attempts_of",
        "run_at",
        "progress",
        "created_at",
        "finished_at",
        "dead_reason",
    ]
    list_filter = ["state", JobTypeFilter, QueueFilter, TenantFilter]
    search_help_text = "A job id, or an idempotency key."
    search_fields = ["=idempotency_key"]  # ids are matched exactly in get_search_results
    show_full_result_count = False
    list_per_page = 50
    ordering = ["-created_at"]
    inlines = [JobRunInline]
    actions = ["replay_selected", "cancel_selected"]
    fields = [
        "id",
        "type",
        "type_owner",
        "type_replay_safe",
        "state",
        "queue",
        "priority",
        "tenant_id",
        "idempotency_key",
        "version",
        "attempts",
        "max_attempts",
        "progress",
        "run_at",
        "deadline",
        "lease_until",
        "lock_key",
        "created_at",
        "started_at",
        "finished_at",
        "last_error",
        "dead_reason",
    ]
    readonly_fields = fields
    change_list_template = "admin/trusty_jobs/job/change_list.html"

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def has_replay_permission(self, request):
        return request.user.has_perm("trusty_jobs.replay_job")

    def has_cancel_permission(self, request):
        return request.user.has_perm("trusty_jobs.cancel_job")

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip()
        if not term:
            return queryset, False
        as_uuid = uuid_or_none(term)
        if as_uuid:
            return queryset.filter(id=as_uuid), False
        return queryset.filter(idempotency_key=term), False

    @admin.display(description="attempts")
    def attempts_of(self, job):
        return f"{job.attempts} of {job.max_attempts}"

    @admin.display(description="progress")
    def progress(self, job):
        return _progress_text(job)

    @admin.display(description="type's owner")
    def type_owner(self, job):
        spec = JOB_TYPES.get(job.type)
        return (spec.owner or "—") if spec else "not registered in this process"

    @admin.display(description="replay-safe", boolean=True)
    def type_replay_safe(self, job):
        spec = JOB_TYPES.get(job.type)
        return spec.replay_safe if spec else False

    @admin.action(description="Replay selected dead jobs (same id)", permissions=["replay"])
    def replay_selected(self, request, queryset):
        return self._confirm(request, queryset, "replay")

    @admin.action(description="Cancel selected pending jobs", permissions=["cancel"])
    def cancel_selected(self, request, queryset):
        return self._confirm(request, queryset, "cancel")

    def _confirm(self, request, queryset, operation):
        """A confirmation page first; replaying a type not replay-safe (or not registered
        here) needs the extra confirmation, as for deliveries (``confirm``). Returns None
        once done."""
        ids = list(queryset.values_list("id", flat=True)[: MAX_SELECTED + 1])
        if len(ids) > MAX_SELECTED:
            self.message_user(request, f"Select at most {MAX_SELECTED:,} jobs.", messages.ERROR)
            return None
        types = Counter(Job.objects.filter(id__in=ids).values_list("type", flat=True))
        selection = Selection(
            ids=ids,
            types=types,
            safe={t for t in types if t in JOB_TYPES and JOB_TYPES[t].replay_safe},
            owners={t: JOB_TYPES[t].owner for t in types if t in JOB_TYPES},
        )
        service = services.job_replay if operation == "replay" else services.job_cancel
        return confirm_operation(
            self,
            request,
            JOB_OPERATIONS[operation],
            selection,
            run=lambda ids: service(job_ids=ids, actor=request.user, via="admin"),
            back=reverse("admin:trusty_jobs_job_changelist"),
        )

    def get_urls(self):
        return [
            path(
                "dead/",
                self.admin_site.admin_view(self.dead_jobs_view),
                name="trusty_jobs_job_dead",
            ),
            *super().get_urls(),
        ]

    def dead_jobs_view(self, request):
        """Dead jobs grouped by type and reason, largest groups first (index job_dead)."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        groups = list(
            Job.objects.filter(state=JobState.DEAD)
            .values("type", "dead_reason")
            .annotate(count=Count("*"), latest=Max("finished_at"))
            .order_by("-count")[:200]
        )
        changelist = reverse("admin:trusty_jobs_job_changelist")
        rows = [
            {
                **g,
                "owner": JOB_TYPES[g["type"]].owner if g["type"] in JOB_TYPES else "",
                "replay_safe": g["type"] in JOB_TYPES and JOB_TYPES[g["type"]].replay_safe,
                "link": f"{changelist}?state=dead&type={g['type']}",
            }
            for g in groups
        ]
        context = {
            **self.admin_site.each_context(request),
            "title": "Dead jobs",
            "rows": rows,
            "opts": self.model._meta,
        }
        return TemplateResponse(request, "admin/trusty_jobs/dead_jobs.html", context)


class RecurringJobForm(forms.ModelForm):
    job_type = forms.ChoiceField(choices=())

    class Meta:
        model = RecurringJob
        fields = ["name", "job_type", "cron", "time_zone", "payload", "tenant_id", "enabled"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        known = sorted(JOB_TYPES)
        if self.instance.job_type and self.instance.job_type not in known:
            known.append(self.instance.job_type)  # shown, then refused by clean()
        self.fields["job_type"].choices = [(t, t) for t in known]

    def clean_job_type(self) -> str:
        job_type = self.cleaned_data["job_type"]
        problem = services.job_type_problem(job_type)
        if problem:
            raise forms.ValidationError(problem)
        return job_type


@admin.register(RecurringJob)
class RecurringJobAdmin(AuditedEdits, ConsoleAdmin, admin.ModelAdmin):
    form = RecurringJobForm
    audited_by_services = True  # recurring_job_save, recurring_jobs_delete
    list_display = [
        "name",
        "job_type",
        "cron",
        "time_zone",
        "enabled",
        "last_scheduled_tick",
        "next_tick_at",
    ]
    list_filter = ["enabled"]
    search_fields = ["name", "job_type"]
    readonly_fields = ["last_scheduled_tick", "next_tick_at", "created_at"]

    def save_model(self, request, obj, form, change):
        services.recurring_job_save(
            recurring_job=obj, actor=request.user, changed=form.changed_data
        )

    def delete_model(self, request, obj):
        services.recurring_jobs_delete(recurring_job_ids=[obj.pk], actor=request.user)

    def delete_queryset(self, request, queryset):
        services.recurring_jobs_delete(
            recurring_job_ids=list(queryset.values_list("pk", flat=True)), actor=request.user
        )
