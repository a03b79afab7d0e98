"""The catalogue entries of the events the service itself sends a tenant about its
endpoints (deliveries/alerts.py): ``endpoint.disabled`` and ``endpoint.failing``. A type
of that name the team already catalogued is left as it is."""

from django.db import migrations

NOTICE_SCHEMA = {
    "type": "object",
    "required": ["endpoint_id", "url_host", "enabled", "incident_id", "occurred_at"],
    "properties": {
        "endpoint_id": {"type": "string", "format": "uuid"},
        "url_host": {"type": "string"},
        "enabled": {"type": "boolean"},
        "reason": {"type": "string"},
        "failing_since": {"type": ["string", "null"], "format": "date-time"},
        "disabled_at": {"type": ["string", "null"], "format": "date-time"},
        "incident_id": {"type": "integer"},
        "occurred_at": {"type": "string", "format": "date-time"},
    },
}
EXAMPLE = {
    "endpoint_id": "0b7e8f55-3f0e-4c53-9a55-6f2f2a1f4b6e",
    "url_host": "hooks.example.com",
    "enabled": False,
    "reason": "the endpoint answered 410 Gone",
    "failing_since": "2026-03-02T08:15:00+00:00",
    "disabled_at": "2026-03-02T09:40:12+00:00",
    "incident_id": 812,
    "occurred_at": "2026-03-02T09:40:12+00:00",
}
TYPES = {
    "endpoint.disabled": (
        "One of your endpoints was disabled (it answered 410 Gone, or failed for too long): "
        "deliveries to it have stopped until it is enabled again. Sent to your other "
        "endpoints that subscribe to it by name or to endpoint.*.",
        EXAMPLE,
    ),
    "endpoint.failing": (
        "One of your endpoints has been failing for a while; deliveries are being retried "
        "and it will be disabled if it keeps failing. Sent to your other endpoints that "
        "subscribe to it by name or to endpoint.*.",
        {**EXAMPLE, "enabled": True, "reason": "", "disabled_at": None},
    ),
}


def add(apps, schema_editor):
    EventType = apps.get_model("deliveries", "EventType")
    EventTypeVersion = apps.get_model("deliveries", "EventTypeVersion")
    for name, (description, example) in TYPES.items():
        event_type, created = EventType.objects.get_or_create(
            name=name,
            defaults={
                "owner": "Webhooks service",
                "description": description,
                "replay_safe": True,
                "validation": "warn",
            },
        )
        if created:
            EventTypeVersion.objects.create(
                event_type=event_type, version=1, schema=NOTICE_SCHEMA, example=example
            )


def remove(apps, schema_editor):
    apps.get_model("deliveries", "EventType").objects.filter(
        name__in=TYPES, owner="Webhooks service"
    ).delete()


class Migration(migrations.Migration):
    dependencies = [("deliveries", "0029_tenant_notifications")]

    operations = [migrations.RunPython(add, remove)]
