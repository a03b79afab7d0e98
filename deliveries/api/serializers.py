"""Input and output shapes of the customer API. No secret appears in any output except
the endpoint secret in the answers to create and rotate-secret, once."""

from django.utils.dateparse import parse_datetime
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from deliveries.core.conf import settings

from ..catalogue import validate_event_type_filter
from ..core.egress import validate_endpoint_url
from ..core.headers import MAX_VALUE_LENGTH, validate_endpoint_headers
from ..jobs.models import Job
from ..jobs.selectors import job_progress
from ..models import Attempt, Delivery, Endpoint, Event, EventType, EventTypeVersion
from ..selectors import attempt_request_headers, delivery_explain, egress_policy_for
from .parsers import StrictJSONField

NAIVE_TIME = (
    "Give the time with its UTC offset, as in 2026-01-01T09:00:00Z or "
    "2026-01-01T10:00:00+01:00: a time without one is ambiguous."
)


def is_naive_time(value) -> bool:
    """Whether ``value`` is ISO 8601 text of a time without a UTC offset (text that is no
    time at all is the field's own parser's to refuse)."""
    try:
        parsed = parse_datetime(value.strip()) if isinstance(value, str) else None
    except ValueError:  # well formed, out of range: "2026-02-30T25:61:61"
        return False
    return parsed is not None and parsed.tzinfo is None


class AwareDateTimeField(serializers.DateTimeField):
    """ISO 8601 with a UTC offset; a time without one is refused, never taken as UTC
    silently (DRF's own field would read it in the server's time zone)."""

    default_error_messages = {"naive": NAIVE_TIME}

    def to_internal_value(self, value):
        if is_naive_time(value):
            self.fail("naive")
        return super().to_internal_value(value)


class EndpointInput(serializers.Serializer):
    url = serializers.URLField(max_length=2000)
    description = serializers.CharField(max_length=500, required=False, allow_blank=True)
    event_types = serializers.ListField(
        child=serializers.CharField(max_length=200),
        required=False,
        max_length=100,
        validators=[validate_event_type_filter],
        help_text="Event types to receive: names, or a dotted prefix with a wildcard "
        "(invoice.*); empty: every type.",
    )
    enabled = serializers.BooleanField(required=False)
    rate_limit = serializers.FloatField(required=False, allow_null=True, min_value=0.01)
    max_concurrency = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=10_000
    )
    timeout = serializers.FloatField(required=False, allow_null=True, min_value=0.1)
    # Values untrimmed: the header rule refuses a CR or LF rather than have it cut off.
    headers = serializers.DictField(
        child=serializers.CharField(max_length=MAX_VALUE_LENGTH, trim_whitespace=False),
        required=False,
        validators=[validate_endpoint_headers],
    )
    retry_client_errors = serializers.BooleanField(required=False)

    def validate_url(self, url: str) -> str:
        # The networks open to the caller's tenant (and to the endpoint being changed)
        # count, as they will when the worker sends: context "tenant" and "endpoint".
        tenant, endpoint = self.context.get("tenant"), self.context.get("endpoint")
        validate_endpoint_url(
            url,
            egress_policy_for(
                tenant_id=tenant.id if tenant else None,
                endpoint_id=endpoint.id if endpoint else None,
            ),
        )
        return url

    def validate_timeout(self, timeout):
        if timeout is not None and timeout > settings.DELIVERY_MAX_TIMEOUT:
            raise serializers.ValidationError(f"at most {settings.DELIVERY_MAX_TIMEOUT} seconds")
        return timeout


class EndpointOutput(serializers.ModelSerializer):
    # Custom header values may be credentials: only their names are shown.
    header_names = serializers.SerializerMethodField()
    paused = serializers.BooleanField(
        read_only=True,
        help_text="Its deliveries are held (pending, not sent) until it is resumed.",
    )

    class Meta:
        model = Endpoint
        fields = [
            "id",
            "url",
            "description",
            "event_types",
            "enabled",
            "disabled_reason",
            "disabled_at",
            "failing_since",
            "paused",
            "paused_at",
            "paused_reason",
            "rate_limit",
            "max_concurrency",
            "timeout",
            "header_names",
            "retry_client_errors",
            "created_at",
            "updated_at",
        ]

    def get_header_names(self, endpoint) -> list[str]:
        return sorted(endpoint.headers or {})


class EndpointWithSecret(EndpointOutput):
    secret = serializers.CharField(read_only=True)

    class Meta(EndpointOutput.Meta):
        fields = [*EndpointOutput.Meta.fields, "secret"]


class PauseInput(serializers.Serializer):
    reason = serializers.CharField(
        max_length=200, required=False, allow_blank=True, help_text="Why, for the log."
    )


class SecretOutput(serializers.Serializer):
    secret = serializers.CharField()
    previous_secrets_expire_at = serializers.DateTimeField()


PAYLOAD_EXAMPLE = {"invoice_id": "in_1029", "amount": 4200, "currency": "EUR"}


PAYLOAD_SCHEMA = {
    "type": "object",
    "additionalProperties": True,
    "description": "A JSON object: the body receivers get.",
    "example": PAYLOAD_EXAMPLE,
}


@extend_schema_field(PAYLOAD_SCHEMA)
class PayloadField(StrictJSONField):
    pass


class EventInput(serializers.Serializer):
    event_type = serializers.CharField(max_length=200)
    payload = PayloadField(help_text="A JSON object: the body receivers get.")
    payload_version = serializers.IntegerField(
        required=False,
        min_value=1,
        max_value=32767,
        help_text="The version of the type's payload schema this payload follows (1).",
    )
    entity_id = serializers.CharField(max_length=200, required=False, allow_blank=True)
    priority = serializers.IntegerField(required=False, min_value=-100, max_value=100)
    deliver_at = AwareDateTimeField(
        required=False, help_text="Hold the deliveries until then; with a UTC offset."
    )

    def validate_payload(self, payload):
        if not isinstance(payload, dict):
            raise serializers.ValidationError("must be a JSON object")
        return payload


class EventOutput(serializers.ModelSerializer):
    payload = serializers.SerializerMethodField()

    class Meta:
        model = Event
        fields = [
            "id",
            "event_type",
            "payload_version",
            "payload",
            "entity_id",
            "priority",
            "created_at",
        ]

    @extend_schema_field(PAYLOAD_SCHEMA)
    def get_payload(self, event) -> dict:
        import json

        return json.loads(bytes(event.body))


class DeliveryOutput(serializers.ModelSerializer):
    event_type = serializers.CharField(source="event.event_type")
    explanation = serializers.SerializerMethodField()

    class Meta:
        model = Delivery
        fields = [
            "id",
            "event_id",
            "event_type",
            "endpoint_id",
            "state",
            "attempt_count",
            "next_attempt_at",
            "last_attempt_at",
            "last_status_code",
            "last_outcome",
            "created_at",
            "finished_at",
            "explanation",
        ]

    def get_explanation(self, delivery) -> str:
        return delivery_explain(delivery).sentence


REQUEST_HEADERS_HELP = (
    "The request's headers in the order sent, as the receiver got them. A value that is "
    "not kept is a marker: a custom header's \"[redacted]\", the signature's "
    '"[not stored]"; a header the header rule kept back is "[dropped]" (not sent).'
)


class AttemptOutput(serializers.ModelSerializer):
    request_headers = serializers.SerializerMethodField(help_text=REQUEST_HEADERS_HELP)

    class Meta:
        model = Attempt
        fields = [
            "number",
            "started_at",
            "duration_ms",
            "status_code",
            "outcome",
            "error_kind",
            "error",
            "ambiguous",
            "response_body",
            "response_truncated",
            "request_headers",
        ]

    @extend_schema_field(serializers.DictField(child=serializers.CharField()))
    def get_request_headers(self, attempt) -> dict[str, str]:
        return attempt_request_headers(attempt)


class RecoverInput(serializers.Serializer):
    since = AwareDateTimeField()
    endpoint_id = serializers.UUIDField(required=False)


class EventTypeVersionOutput(serializers.ModelSerializer):
    schema = serializers.JSONField(help_text="JSON Schema (Draft 2020-12) of the payload.")
    example = serializers.JSONField(help_text="An example payload.")

    class Meta:
        model = EventTypeVersion
        fields = ["version", "schema", "example", "created_at"]


class EventTypeOutput(serializers.ModelSerializer):
    group = serializers.CharField(
        help_text="The dotted prefix the type is grouped under; subscribe to the group "
        "with <group>.*."
    )
    versions = EventTypeVersionOutput(many=True)

    class Meta:
        model = EventType
        fields = ["name", "group", "description", "owner", "validation", "versions"]


class PortalLinkInput(serializers.Serializer):
    ttl = serializers.IntegerField(
        required=False,
        min_value=1,
        help_text="Seconds the link stays valid (PORTAL_LINK_TTL by default, at most "
        "PORTAL_LINK_MAX_TTL).",
    )


class PortalLinkOutput(serializers.Serializer):
    url = serializers.CharField(help_text="Open it once, before expires_at.")
    expires_at = serializers.DateTimeField()


class CountOutput(serializers.Serializer):
    count = serializers.IntegerField()


class JobProgressOutput(serializers.Serializer):
    done = serializers.IntegerField(allow_null=True)
    total = serializers.IntegerField(allow_null=True)
    rate = serializers.FloatField(allow_null=True, help_text="Items a second in this run.")
    eta_seconds = serializers.FloatField(
        allow_null=True, help_text="Seconds left at that rate; null unless running with a total."
    )


class JobOutput(serializers.ModelSerializer):
    progress = serializers.SerializerMethodField()

    class Meta:
        model = Job
        fields = [
            "id",
            "type",
            "state",
            "attempts",
            "max_attempts",
            "progress",
            "run_at",
            "created_at",
            "started_at",
            "finished_at",
            "dead_reason",
        ]

    @extend_schema_field(JobProgressOutput)
    def get_progress(self, job) -> dict:
        p = job_progress(job)
        return {
            "done": p.done,
            "total": p.total,
            "rate": None if p.rate is None else round(p.rate, 3),
            "eta_seconds": None if p.eta_seconds is None else round(p.eta_seconds, 1),
        }
