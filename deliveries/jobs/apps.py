from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "deliveries.jobs"
    # Namespaced: a host project may well have an app labelled "jobs" of its own.
    label = "trusty_jobs"
    verbose_name = "Job machinery"
    default_auto_field = "django.db.models.BigAutoField"
