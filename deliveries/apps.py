from django.apps import AppConfig

# What a host adds to its INSTALLED_APPS, in this order: the apps and the apps they need
# (docs/install.md). Not drf_spectacular: the API's schema and docs page work without it,
# and installed it runs its deploy check over the host's own DRF views, which fails
# unless the host's DEFAULT_SCHEMA_CLASS is drf-spectacular's. A host whose own API uses
# drf-spectacular lists it itself.
TRUSTY_APPS = (
    "rest_framework",
    "django_filters",
    "drf_spectacular_sidecar",  # Swagger UI's files for /api/docs/, without a CDN
    "django_q",  # its Schedule rows: the maintenance schedules (install_schedules)
    "deliveries",
    "deliveries.jobs",  # the job machinery (label trusty_jobs)
    "ingest",
)


class DeliveriesConfig(AppConfig):
    name = "deliveries"
    verbose_name = "Outbound webhooks"
    # The key type its migrations were made with, whatever the host's DEFAULT_AUTO_FIELD.
    default_auto_field = "django.db.models.BigAutoField"
    # Composed by deliveries.urls: the customer API's routes of this app.
    api_router = "deliveries.api.urls.router"

    def ready(self) -> None:
        from django.db.models.signals import post_delete, post_save

        from deliveries.core.audit import register_audit
        from deliveries.core.prometheus import register_provider

        from . import (
            alerts,  # noqa: F401  (registers the product's alert checks)
            checks,  # noqa: F401  (registers the system checks)
            retention,  # noqa: F401  (registers the product's pruners)
            services,
        )
        from .core import tracing
        from .jobs import kinds
        from .jobs import services as job_services
        from .jobs.metrics import job_gauges
        from .metrics import delivery_gauges
        from .models import EventType, EventTypeVersion
        from .schemas import forget_schemas
        from .selectors import delivery_trace_contexts, tenant_choices
        from .statements import DELIVERY_KIND

        # A catalogue change made in this process applies to its next publish at once.
        for model in (EventType, EventTypeVersion):
            post_save.connect(forget_schemas, sender=model, dispatch_uid=f"forget-{model}")
            post_delete.connect(forget_schemas, sender=model, dispatch_uid=f"forget-d-{model}")
        tracing.configure()
        register_provider("deliveries", delivery_gauges)
        # The background jobs' gauges, and the audit rows and tenant names their admin
        # needs: the machinery imports no product module, so the product hands them over.
        register_provider("jobs", job_gauges)
        register_audit(services.audit)
        job_services.register_tenant_choices(tenant_choices)
        # Deliveries are a job kind whose admission and sending the scheduler and the
        # workers' lanes own; the relay reads their trace contexts through the kind.
        kinds.register(kinds.JobKind(DELIVERY_KIND, trace_contexts=delivery_trace_contexts))
