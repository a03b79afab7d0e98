from billing.api import InvoiceList
from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("host/invoices/", InvoiceList.as_view()),
    # The product: everything it serves, in one line.
    path("", include("deliveries.urls")),
]
