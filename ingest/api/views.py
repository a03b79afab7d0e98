"""``GET /api/v1/backfill-runs/`` and ``/{id}/``: a backfill's progress for a front end to
poll, read-only. Runs are the caller's tenant's: those of poll sources with that tenant
(a source without a tenant is the operator's own, seen in the admin only). Another
tenant's run is a 404, exactly like a random id."""

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers, viewsets

from deliveries.api.views import TenantScoped

from ..models import BackfillRun
from ..selectors import backfill_progress


class BackfillRunOutput(serializers.ModelSerializer):
    source = serializers.CharField(source="source.source.slug")
    progress = serializers.SerializerMethodField(help_text="0 to 1.")
    records_per_second = serializers.SerializerMethodField()
    requests_per_second = serializers.SerializerMethodField()
    eta_seconds = serializers.SerializerMethodField(help_text="null when not running.")
    checkpoint = serializers.DateTimeField(source="checkpoint_at", allow_null=True)

    class Meta:
        model = BackfillRun
        fields = [
            "id",
            "source",
            "state",
            "since",
            "until",
            "rate",
            "page_size",
            "processed",
            "stored",
            "duplicates",
            "pages",
            "requests",
            "total",
            "checkpoint",
            "progress",
            "records_per_second",
            "requests_per_second",
            "eta_seconds",
            "created_at",
            "heartbeat_at",
            "finished_at",
            "error",
        ]
        read_only_fields = fields

    def _progress(self, run):
        if not hasattr(run, "_progress"):
            run._progress = backfill_progress(run)
        return run._progress

    @extend_schema_field(serializers.FloatField())
    def get_progress(self, run):
        return round(self._progress(run).fraction, 4)

    @extend_schema_field(serializers.FloatField())
    def get_records_per_second(self, run):
        return round(self._progress(run).records_per_second, 2)

    @extend_schema_field(serializers.FloatField())
    def get_requests_per_second(self, run):
        return round(self._progress(run).requests_per_second, 3)

    @extend_schema_field(serializers.FloatField(allow_null=True))
    def get_eta_seconds(self, run):
        eta = self._progress(run).eta_seconds
        return None if eta is None else round(eta, 1)


class BackfillRunViewSet(TenantScoped, viewsets.ReadOnlyModelViewSet):
    serializer_class = BackfillRunOutput

    def get_queryset(self):
        return BackfillRun.objects.filter(source__tenant=self.tenant).select_related(
            "source__source"
        )
