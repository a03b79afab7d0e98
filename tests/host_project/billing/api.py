"""The host's own API: its REST_FRAMEWORK's auth, page numbers and error shape."""

from rest_framework import generics, serializers
from rest_framework.response import Response

from .models import Invoice


def host_errors(exc, context):
    status = getattr(exc, "status_code", 500)
    return Response({"host_error": {"status": status, "detail": str(exc)}}, status=status)


class InvoiceOut(serializers.ModelSerializer):
    class Meta:
        model = Invoice
        fields = ["number", "amount_cents"]


class InvoiceList(generics.ListAPIView):
    queryset = Invoice.objects.order_by("id")
    serializer_class = InvoiceOut
