"""The portal's routes, mounted by deliveries.urls at ``portal/``. Object ids are taken
as text and checked in the views, so that a malformed id is the same 404 as an unknown
one (tests/deliveries/test_portal.py sweeps every route with two tenants)."""

from django.urls import path

from . import views

app_name = "trusty_portal"

urlpatterns = [
    path("enter/", views.enter, name="enter"),
    path("leave/", views.leave, name="leave"),
    path("assets/<str:name>", views.asset, name="asset"),
    path("theme.css", views.theme, name="theme"),
    path("", views.endpoints, name="endpoints"),
    path("endpoints/new/", views.endpoint_new, name="endpoint_new"),
    path("endpoints/<str:pk>/", views.endpoint_detail, name="endpoint"),
    path("endpoints/<str:pk>/test/", views.endpoint_test, name="endpoint_test"),
    path("endpoints/<str:pk>/rotate/", views.endpoint_rotate, name="endpoint_rotate"),
    path("endpoints/<str:pk>/enable/", views.endpoint_enable, name="endpoint_enable"),
    path("endpoints/<str:pk>/pause/", views.endpoint_pause, name="endpoint_pause"),
    path("endpoints/<str:pk>/resume/", views.endpoint_resume, name="endpoint_resume"),
    path("deliveries/", views.deliveries, name="deliveries"),
    path("deliveries/<str:pk>/", views.delivery_detail, name="delivery"),
    path("deliveries/<str:pk>/replay/", views.delivery_replay, name="delivery_replay"),
    path("recover/", views.recover, name="recover"),
    path("event-types/", views.catalogue, name="catalogue"),
    path("verify/", views.verify, name="verify"),
]
