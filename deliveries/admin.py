"""Operator console (a first cut: read-only history and replay)."""

from django.contrib import admin, messages

from . import services
from .models import Attempt, Delivery, Endpoint, Event, LoopRun, Tenant


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["name", "id", "created_at"]
    search_fields = ["name"]


@admin.register(Endpoint)
class EndpointAdmin(admin.ModelAdmin):
    list_display = ["url", "tenant", "enabled", "failing_since", "disabled_reason"]
    list_filter = ["enabled"]
    search_fields = ["url", "id"]
    readonly_fields = ["failing_since", "disabled_at", "disabled_reason"]


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    list_display = ["id", "event_type", "tenant", "entity_id", "created_at"]
    search_fields = ["id", "entity_id"]
    show_full_result_count = False


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
        "response_body",
    ]
    readonly_fields = fields
    extra = 0
    can_delete = False
    ordering = ["number", "id"]

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Delivery)
class DeliveryAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "state",
        "endpoint",
        "attempt_count",
        "next_attempt_at",
        "last_status_code",
        "last_outcome",
        "created_at",
    ]
    list_filter = ["state", "last_outcome"]
    search_fields = ["=id", "=event__id", "=event__entity_id"]
    list_select_related = ["endpoint"]
    show_full_result_count = False
    inlines = [AttemptInline]
    actions = ["replay"]

    @admin.action(description="Replay: send again with the same webhook-id")
    def replay(self, request, queryset):
        n = services.delivery_replay(delivery_ids=list(queryset.values_list("id", flat=True)))
        self.message_user(request, f"{n} deliveries returned to pending.", messages.SUCCESS)


@admin.register(LoopRun)
class LoopRunAdmin(ReadOnlyAdmin):
    list_display = ["kind", "host", "pid", "started_at", "heartbeat_at", "finished_at", "ticks"]
    list_filter = ["kind"]
