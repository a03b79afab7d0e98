from django.contrib import admin
from django.urls import include, path, reverse_lazy

from deliveries.api.errors import not_found_under
from deliveries.models import Delivery

# The standalone service's console: branded as the product, landing on the overview,
# with the console's own navigation bar (templates/admin/base_site.html) in place of
# Django's sidebar, which would take a fifth of a 1366-pixel screen from the lists; and
# "View site" leading to the API's documentation, the service's public face.
admin.site.site_header = admin.site.site_title = "Trusty webhooks"
admin.site.index_title = "Operator console"
admin.site.site_url = reverse_lazy("api-docs")
admin.site.enable_nav_sidebar = False


def console_home(request):
    """/admin/: the overview (deliveries' admin page) with the app list at its foot, for
    staff who may view deliveries; Django's index of what they may see for the others."""
    deliveries = admin.site.get_model_admin(Delivery)
    if not deliveries.has_view_permission(request):
        return admin.site.index(request)
    return deliveries.overview_view(request)


# The standalone service is one host of the apps like any other: its admin, and the one
# line that mounts everything the product serves (deliveries/urls.py).
urlpatterns = [
    path("admin/", admin.site.admin_view(console_home), name="console-home"),
    path("admin/", admin.site.urls),
    path("", include("deliveries.urls")),
]

# A path under the API or the receiver that routes nowhere answers in the one error shape.
handler404 = not_found_under("/api/", "/ingest/")
