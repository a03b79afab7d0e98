"""The inbound receiver's route, mounted by ``deliveries.urls``."""

from django.urls import path

from . import views

urlpatterns = [
    path("ingest/<slug:slug>/", views.receive, name="ingest-receive"),
    # Mailgun posts the raw message only to a URL that ends in "mime": the same view.
    path("ingest/<slug:slug>/mime", views.receive, name="ingest-receive-mime"),
]
