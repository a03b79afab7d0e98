"""Input and output shapes of the customer API. No secret appears in any output except
the endpoint secret in the answers to create and rotate-secret, once."""

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from deliveries.conf import settings

from ..egress import validate_endpoint_url
from ..headers import MAX_VALUE_LENGTH, validate_endpoint_headers
from ..jobs.models import Job
from ..jobs.selectors import job_progress
from ..models import Attempt, Delivery, Endpoint, Event
from ..selectors import delivery_explain, egress_policy_for
from .parsers import StrictJSONField


class EndpointInput(serializers.Serializer):
    url = serializers.URLField(max_length=2000)
    description = serializers.CharField(max_length=500, required=False, allow_blank=True)
    event_types = serializers.ListField(
        child=serializers.CharField(max_length=200), required=False, max_length=100
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


class EventInput(serializers.Serializer):
    event_type = serializers.CharField(max_length=200)
    payload = StrictJSONField(help_text="A JSON object: the body receivers get.")
    entity_id = serializers.CharField(max_length=200, required=False, allow_blank=True)
    priority = serializers.IntegerField(required=False, min_value=-100, max_value=100)
    deliver_at = serializers.DateTimeField(required=False)

    def validate_payload(self, payload):
        if not isinstance(payload, dict):
            raise serializers.ValidationError("must be a JSON object")
        return payload


class EventOutput(serializers.ModelSerializer):
    payload = serializers.SerializerMethodField()

    class Meta:
        model = Event
        fields = ["id", "event_type", "payload", "entity_id", "priority", "created_at"]

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


class AttemptOutput(serializers.ModelSerializer):
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


class RecoverInput(serializers.Serializer):
    since = serializers.DateTimeField()
    endpoint_id = serializers.UUIDField(required=False)


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
