from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "deliveries.jobs"
    # Namespaced: a host project may well have an app labelled "jobs" of its own.
    label = "trusty_jobs"
    verbose_name = "Job machinery"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from importlib import import_module

        from deliveries.core.conf import settings

        from . import kinds
        from .background.registry import KIND
        from .background.sweeps import jobs_schedule

        # The host's background jobs: a kind whose schedule (run by run_scheduler)
        # returns expired leases and ends jobs past their deadline; run_jobs claims them.
        kinds.register(kinds.JobKind(KIND, schedule=jobs_schedule))
        # The host's job modules (they register with @job on import).
        for module in settings.JOBS_MODULES:
            import_module(module)
