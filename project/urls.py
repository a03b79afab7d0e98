from django.contrib import admin
from django.urls import include, path

# The standalone service is one host of the apps like any other: its admin, and the one
# line that mounts everything the product serves (deliveries/urls.py).
urlpatterns = [
    path("admin/", admin.site.urls),
    path("", include("deliveries.urls")),
]
