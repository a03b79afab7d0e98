"""The inbound receiver's route, mounted by ``deliveries.urls``."""

from django.urls import path

from . import views

urlpatterns = [
    path("ingest/<slug:slug>/", views.receive, name="ingest-receive"),
]
