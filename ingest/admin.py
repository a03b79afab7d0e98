"""Staff views of inbound webhooks: sources, events (with reprocess), refusals."""

from django.contrib import admin, messages

from deliveries.admin import CappedCountPaginator, ReadOnlyAdmin

from . import services
from .models import HandlerRun, InboundEvent, Source, VerificationFailure


@admin.register(Source)
class SourceAdmin(admin.ModelAdmin):
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
    ]


class HandlerRunInline(admin.TabularInline):
    model = HandlerRun
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
    paginator = CappedCountPaginator
    ordering = ["-received_at"]
    inlines = [HandlerRunInline]
    actions = ["reprocess"]
    exclude = ["body"]

    @admin.action(description="Process again (audited)", permissions=["change"])
    def reprocess(self, request, queryset):
        n = services.inbound_reprocess(
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
