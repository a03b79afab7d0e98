"""The URLconf of tests/host_settings_rest.py: a view of the host's own, on the host's
REST_FRAMEWORK, beside the one include() of the product."""

from django.contrib.auth.models import User
from django.urls import include, path
from rest_framework import generics, serializers
from rest_framework.response import Response


def host_errors(exc, context):
    return Response({"host_error": str(exc)}, status=getattr(exc, "status_code", 500))


class UserOut(serializers.ModelSerializer):
    class Meta:
        model = User
        fields = ["username"]


class HostUsers(generics.ListAPIView):
    queryset = User.objects.order_by("id")
    serializer_class = UserOut


urlpatterns = [
    path("host/users/", HostUsers.as_view()),
    path("", include("deliveries.urls")),
]
