from django.urls import path

from .api.base import SchemaDocsView, SchemaView

# The routes themselves are composed at /api/v1/ in deliveries/urls.py.
urlpatterns = [
    path("schema/", SchemaView.as_view(), name="schema"),
    path("docs/", SchemaDocsView.as_view(url_name="schema"), name="api-docs"),
]
