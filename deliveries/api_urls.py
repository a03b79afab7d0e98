from django.urls import path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

# The routes themselves are composed at /api/v1/ in deliveries/urls.py.
urlpatterns = [
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
]
