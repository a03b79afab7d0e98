from django.contrib import admin
from django.urls import include, path

from deliveries.api.errors import not_found_under

# The standalone service is one host of the apps like any other: its admin, and the one
# line that mounts everything the product serves (deliveries/urls.py).
urlpatterns = [
    path("admin/", admin.site.urls),
    path("", include("deliveries.urls")),
]

# A path under the API or the receiver that routes nowhere answers in the one error shape.
handler404 = not_found_under("/api/", "/ingest/")
