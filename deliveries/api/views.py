"""The customer REST API under /api/v1/. Every queryset is filtered by the caller's
tenant in ``get_queryset``; an id of another tenant is a 404, the same as a random id."""

from datetime import UTC

import django_filters
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import F
from drf_spectacular.utils import OpenApiExample, OpenApiParameter
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from .. import services
from ..core.text import text_problem
from ..jobs.models import Job
from ..models import (
    Attempt,
    Delivery,
    DeliveryState,
    Endpoint,
    EndpointSecret,
    Event,
    EventType,
)
from ..portal.links import enter_path, portal_link_create
from . import serializers as s
from .auth import ApiKeyAuthentication, ApiKeyThrottle, IsTenant
from .base import ProductAPIView, extend_schema
from .pagination import AttemptPages, ByName, NewestDeliveriesFirst, NewestFirst


class UnknownQueryParameter(services.DomainError):
    code = "unknown_parameter"
    status = 400


class TenantScoped(ProductAPIView):
    # The customer API: a tenant's API key, its throttle and cursor pages.
    authentication_classes = [ApiKeyAuthentication]
    permission_classes = [IsTenant]
    throttle_classes = [ApiKeyThrottle]
    pagination_class = NewestFirst
    lookup_value_regex = "[^/]+"

    def filter_queryset(self, queryset):
        # List filters apply to lists only, never to the lookup of one object.
        if self.action != "list":
            return queryset
        return super().filter_queryset(queryset)

    @property
    def tenant(self):
        if getattr(self, "swagger_fake_view", False):  # schema generation: no caller
            return None
        return self.request.user.tenant

    def initial(self, request, *args, **kwargs):
        # After authentication and the throttle: an anonymous caller learns nothing.
        super().initial(request, *args, **kwargs)
        self.refuse_unknown_query_parameters(request)

    def query_parameters(self) -> set[str]:
        """The query parameters this action reads: its filters, its paginator's and
        DRF's ``format`` (the browsable API's)."""
        known = {"format"}
        filterset = getattr(self, "filterset_class", None)
        if self.action == "list" and filterset is not None:
            known |= set(filterset.base_filters)
        if self.action == "list" or self.action in self.paginated_actions:
            paginator = self.paginator
            if paginator is not None:
                known |= {paginator.cursor_query_param, paginator.page_size_query_param}
        return known - {None}

    # Detail actions whose answer is a page (their own pagination_class).
    paginated_actions = ()

    def refuse_unknown_query_parameters(self, request) -> None:
        """A query parameter the route does not read is a 400 naming it, never
        silently ignored (``page_size`` where the route reads ``limit``, a misspelt
        filter: a client would take the unfiltered answer for the filtered one)."""
        known = self.query_parameters()
        unknown = sorted(set(request.query_params) - known)
        if unknown:
            raise UnknownQueryParameter(
                f"Unknown query parameter: {', '.join(unknown)[:200]}. This route reads: "
                f"{', '.join(sorted(known)) or 'none'}.",
                details={"unknown": unknown[:20], "known": sorted(known)},
            )

    def created(self, request, data, object_id, headers=None):
        """A 201 with the new object's URL in ``Location``: the collection's own URL,
        wherever the host mounted the API, and the id."""
        location = request.build_absolute_uri(f"{request.path.rstrip('/')}/{object_id}/")
        return Response(
            data, status=status.HTTP_201_CREATED, headers={"Location": location, **(headers or {})}
        )


class EndpointViewSet(TenantScoped, viewsets.ModelViewSet):
    serializer_class = s.EndpointOutput
    http_method_names = ["get", "post", "patch", "delete"]

    def get_queryset(self):
        return Endpoint.objects.filter(tenant=self.tenant)

    @extend_schema(
        request=s.EndpointInput,
        responses={201: s.EndpointWithSecret},
        examples=[
            OpenApiExample(
                "An endpoint for invoice events",
                request_only=True,
                value={
                    "url": "https://hooks.example.com/billing",
                    "description": "Billing service",
                    "event_types": ["invoice.*", "customer.deleted"],
                    "rate_limit": 20,
                },
            )
        ],
    )
    def create(self, request):
        data = s.EndpointInput(data=request.data, context={"tenant": self.tenant})
        data.is_valid(raise_exception=True)
        endpoint, secret = services.endpoint_create(tenant=self.tenant, **data.validated_data)
        endpoint.secret = secret
        return self.created(request, s.EndpointWithSecret(endpoint).data, endpoint.id)

    @extend_schema(request=s.EndpointInput, responses=s.EndpointOutput)
    def partial_update(self, request, pk=None):
        endpoint = self.get_object()
        data = s.EndpointInput(
            data=request.data, partial=True, context={"tenant": self.tenant, "endpoint": endpoint}
        )
        data.is_valid(raise_exception=True)
        endpoint = services.endpoint_update(endpoint=endpoint, **data.validated_data)
        return Response(s.EndpointOutput(endpoint).data)

    @extend_schema(request=None, responses=s.SecretOutput)
    @action(detail=True, methods=["post"], url_path="rotate-secret")
    def rotate_secret(self, request, pk=None):
        endpoint = self.get_object()
        secret = services.endpoint_rotate_secret(endpoint=endpoint)
        expires = (
            EndpointSecret.objects.filter(endpoint=endpoint, expires_at__isnull=False)
            .order_by("-expires_at")
            .values_list("expires_at", flat=True)
            .first()
        )
        return Response({"secret": secret, "previous_secrets_expire_at": expires})

    @extend_schema(request=s.PauseInput, responses=s.EndpointOutput)
    @action(detail=True, methods=["post"])
    def pause(self, request, pk=None):
        """Hold this endpoint's deliveries: they stay pending, and events published
        meanwhile still get theirs, until it is resumed. Pausing a paused endpoint
        changes nothing."""
        endpoint = self.get_object()
        data = s.PauseInput(data=request.data)
        data.is_valid(raise_exception=True)
        services.endpoint_pause(
            endpoint=endpoint,
            reason=data.validated_data.get("reason", ""),
            via=f"api key {request.user.api_key_id}",
        )
        endpoint.refresh_from_db()
        return Response(s.EndpointOutput(endpoint).data)

    @extend_schema(request=None, responses=s.EndpointOutput)
    @action(detail=True, methods=["post"])
    def resume(self, request, pk=None):
        """Let the held deliveries flow: each is due at its own next attempt time."""
        endpoint = self.get_object()
        services.endpoint_resume(endpoint=endpoint, via=f"api key {request.user.api_key_id}")
        endpoint.refresh_from_db()
        return Response(s.EndpointOutput(endpoint).data)

    @extend_schema(request=None, responses={202: s.EventOutput})
    @action(detail=True, methods=["post"])
    def test(self, request, pk=None):
        """Send a ``webhook.test`` event to this endpoint only."""
        event = services.endpoint_send_test(endpoint=self.get_object())
        return Response(s.EventOutput(event).data, status=status.HTTP_202_ACCEPTED)


class UtcDateTimeField(django_filters.fields.IsoDateTimeField):
    """ISO 8601 with any offset Python accepts, normalised to UTC: PostgreSQL refuses
    offsets past ±15:59, and an instant near the ends of the calendar cannot be moved."""

    def to_python(self, value):
        if s.is_naive_time(value):  # never read in the server's zone
            raise ValidationError(s.NAIVE_TIME)
        parsed = super().to_python(value)
        try:
            return parsed.astimezone(UTC) if parsed is not None and parsed.tzinfo else parsed
        except OverflowError as exc:
            raise ValidationError("Enter a date and time within the calendar.") from exc


class UtcDateTimeFilter(django_filters.IsoDateTimeFilter):
    field_class = UtcDateTimeField


class EventFilter(django_filters.FilterSet):
    event_type = django_filters.CharFilter()
    entity_id = django_filters.CharFilter()
    created_after = UtcDateTimeFilter(field_name="created_at", lookup_expr="gte")
    created_before = UtcDateTimeFilter(field_name="created_at", lookup_expr="lt")

    class Meta:
        model = Event
        fields = ["event_type", "entity_id"]


class EventViewSet(
    TenantScoped, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    serializer_class = s.EventOutput
    filterset_class = EventFilter

    def get_queryset(self):
        return Event.objects.filter(tenant=self.tenant)

    @extend_schema(
        request=s.EventInput,
        responses={201: s.EventOutput},
        parameters=[OpenApiParameter("Idempotency-Key", str, OpenApiParameter.HEADER)],
        examples=[
            OpenApiExample(
                "An invoice paid",
                request_only=True,
                value={
                    "event_type": "invoice.paid",
                    "payload": s.PAYLOAD_EXAMPLE,
                    "entity_id": "invoice:in_1029",
                },
            )
        ],
    )
    def create(self, request):
        data = s.EventInput(data=request.data)
        data.is_valid(raise_exception=True)
        key = request.headers.get("Idempotency-Key")
        if key is None:
            event = services.publish_event(tenant=self.tenant, **data.validated_data)
            return self.created(request, s.EventOutput(event).data, event.id)
        if not key.strip() or len(key) > 255 or text_problem(key):
            raise services.DomainError(
                "Idempotency-Key must be 1 to 255 characters, without NUL",
                code="invalid_idempotency_key",
            )
        event, replayed = services.event_publish_idempotent(
            tenant=self.tenant,
            idempotency_key=key,
            request_hash=services.request_fingerprint(request.data),
            **data.validated_data,
        )
        headers = {"Idempotent-Replayed": "true"} if replayed else {}
        return self.created(request, s.EventOutput(event).data, event.id, headers=headers)


class DeliveryFilter(django_filters.FilterSet):
    state = django_filters.ChoiceFilter(choices=DeliveryState.choices)
    endpoint_id = django_filters.UUIDFilter(field_name="listing__endpoint_id")
    event_id = django_filters.UUIDFilter()
    event_type = django_filters.CharFilter(field_name="event__event_type")
    created_after = UtcDateTimeFilter(field_name="listing__created_at", lookup_expr="gte")
    created_before = UtcDateTimeFilter(field_name="listing__created_at", lookup_expr="lt")

    class Meta:
        model = Delivery
        fields = ["state", "endpoint_id", "event_id"]


class DeliveryViewSet(
    TenantScoped, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    serializer_class = s.DeliveryOutput
    filterset_class = DeliveryFilter
    pagination_class = NewestDeliveriesFirst
    paginated_actions = ("attempts",)

    def get_queryset(self):
        # Through the listing: its (tenant, created_at) index is the one a tenant's
        # deliveries are read by, newest first; the delivery row has none.
        return (
            Delivery.objects.filter(listing__tenant=self.tenant)
            .annotate(listed_at=F("listing__created_at"))
            # The endpoint: whether it is paused is part of a delivery's explanation.
            .select_related("event", "endpoint")
        )

    @extend_schema(responses=s.AttemptOutput(many=True), filters=False)
    @action(detail=True, methods=["get"], pagination_class=AttemptPages)
    def attempts(self, request, pk=None):
        """The attempt timeline, oldest first."""
        delivery = self.get_object()
        page = self.paginate_queryset(Attempt.objects.filter(delivery=delivery))
        return self.get_paginated_response(s.AttemptOutput(page, many=True).data)

    @extend_schema(request=None, responses={202: s.CountOutput})
    @action(detail=True, methods=["post"])
    def replay(self, request, pk=None):
        delivery = self.get_object()
        count = services.delivery_replay(
            delivery_ids=[delivery.id], via=f"api key {request.user.api_key_id}"
        )
        return Response({"count": count}, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=s.RecoverInput, responses={202: s.CountOutput})
    @action(detail=False, methods=["post"])
    def recover(self, request):
        """Replay dead deliveries that died since a time (at most 14 days back, 10,000
        at a time)."""
        data = s.RecoverInput(data=request.data)
        data.is_valid(raise_exception=True)
        endpoint_id = data.validated_data.get("endpoint_id")
        if endpoint_id and not Endpoint.objects.filter(id=endpoint_id, tenant=self.tenant).exists():
            return Response(
                {"error": {"code": "not_found", "message": "No such endpoint."}},
                status=status.HTTP_404_NOT_FOUND,
            )
        with transaction.atomic():
            count = services.deliveries_recover(
                tenant=self.tenant, since=data.validated_data["since"], endpoint_id=endpoint_id
            )
        return Response({"count": count}, status=status.HTTP_202_ACCEPTED)


class EventTypeFilter(django_filters.FilterSet):
    group = django_filters.CharFilter(
        method="in_group", help_text="Types under this dotted prefix (invoice: invoice.*)."
    )
    name = django_filters.CharFilter()

    class Meta:
        model = EventType
        fields = ["name"]

    def in_group(self, queryset, name, value):
        return queryset.filter(name__startswith=f"{value}.")


class EventTypeViewSet(TenantScoped, mixins.ListModelMixin, viewsets.GenericViewSet):
    # The event catalogue: every tenant reads the same one (the team's), by name.
    serializer_class = s.EventTypeOutput
    filterset_class = EventTypeFilter
    pagination_class = ByName

    def get_queryset(self):
        return EventType.objects.prefetch_related("versions")


class PortalLinkViewSet(TenantScoped, viewsets.ViewSet):
    # A link into the caller's tenant's portal (deliveries.portal): POST only.

    @extend_schema(request=s.PortalLinkInput, responses={200: s.PortalLinkOutput})
    def create(self, request):
        """A short-lived, single-use link that opens this tenant's portal. Hand it to
        the customer's browser at once; it is not a resource to fetch later."""

        data = s.PortalLinkInput(data=request.data)
        data.is_valid(raise_exception=True)
        link, token = portal_link_create(
            tenant=self.tenant,
            ttl=data.validated_data.get("ttl"),
            via=f"api key {request.user.api_key_id}",
        )
        url = request.build_absolute_uri(enter_path(token))
        return Response({"url": url, "expires_at": link.expires_at})


class JobViewSet(TenantScoped, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    # A background job's state and progress, for a front end to poll: the caller's
    # tenant's jobs only (enqueue(..., tenant=)); another tenant's id is a 404.
    serializer_class = s.JobOutput

    def get_queryset(self):
        return Job.objects.filter(tenant_id=getattr(self.tenant, "id", None))
