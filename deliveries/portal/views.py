"""The portal's pages. Every read is filtered by the session's tenant, so another
tenant's id is the same 404 as a random one; every write calls the service the API and
the admin call (deliveries.services), with ``via`` saying it came from the portal."""

import json
from functools import wraps
from pathlib import Path

from django.db import transaction
from django.db.models import F
from django.http import Http404, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import redirect
from django.utils import timezone

from .. import services
from ..catalogue import group_of
from ..models import Attempt, Delivery, Endpoint, EndpointSecret, EventType
from ..selectors import attempt_request_headers, delivery_explain
from . import access, forms
from .links import portal_link_redeem
from .theme import theme_css

STATIC = Path(__file__).resolve().parent / "static"
ASSETS = {"portal.css": "text/css", "portal.js": "text/javascript"}
PAGE = 50
TERMINAL = ("succeeded", "dead")


def _post_only(request):
    return HttpResponseNotAllowed(["POST"]) if request.method != "POST" else None


# --- Entering and leaving ---------------------------------------------------------------


@access.public_view
def enter(request):
    """GET: the page the link opens; its script posts the token from the fragment (which
    no server ever sees). POST: redeem the token and open the session."""
    if request.method == "POST":
        tenant_id = portal_link_redeem(token=request.POST.get("token", "").strip())
        if tenant_id is None:
            return access.page(
                request, "deliveries/portal/enter.html", {"failed": True}, status=403
            )
        access.open_session(request, tenant_id)
        return redirect("trusty_portal:endpoints")
    return access.page(request, "deliveries/portal/enter.html")


@access.portal_view
def leave(request, tenant):
    if response := _post_only(request):
        return response
    access.close_session(request)
    return access.page(request, "deliveries/portal/left.html")


@access.public_view
def asset(request, name):
    if name not in ASSETS:
        raise Http404
    response = HttpResponse((STATIC / name).read_bytes(), content_type=ASSETS[name])
    return response


@access.public_view
def theme(request):
    return HttpResponse(theme_css(), content_type="text/css")


# --- Endpoints ---------------------------------------------------------------------------


def _endpoint(tenant, pk) -> Endpoint:
    endpoint = Endpoint.objects.filter(tenant=tenant, id=access.object_id(pk)).first()
    if endpoint is None:
        raise Http404
    return endpoint


def _apply_refusal(form, exc: services.DomainError) -> None:
    field, _, message = exc.message.partition(": ")
    if field in form.fields and message:
        form.add_error(field, message)
    elif field == "event_types":
        form.add_error("other_event_types", message)
    else:
        form.add_error(None, exc.message)


@access.portal_view
def endpoints(request, tenant):
    rows = Endpoint.objects.filter(tenant=tenant).order_by("created_at")
    notify = forms.NotificationForm(initial={"notification_email": tenant.notification_email})
    if request.method == "POST":
        notify = forms.NotificationForm(request.POST)
        if notify.is_valid():
            services.tenant_set_notification_email(
                tenant=tenant, email=notify.cleaned_data["notification_email"], via="portal"
            )
            return redirect("trusty_portal:endpoints")
    return access.page(
        request,
        "deliveries/portal/endpoints.html",
        {"endpoints": rows, "notify": notify, "nav": "endpoints"},
    )


@access.portal_view
def endpoint_new(request, tenant):
    form = forms.EndpointForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            endpoint, secret = services.endpoint_create(tenant=tenant, **form.service_fields())
        except services.DomainError as exc:
            _apply_refusal(form, exc)
        else:
            return access.page(
                request,
                "deliveries/portal/secret.html",
                {"endpoint": endpoint, "secret": secret, "created": True, "nav": "endpoints"},
            )
    return access.page(
        request, "deliveries/portal/endpoint_form.html", {"form": form, "nav": "endpoints"}
    )


@access.portal_view
def endpoint_detail(request, tenant, pk):
    endpoint = _endpoint(tenant, pk)
    form = forms.EndpointForm(
        request.POST or None, initial=forms.EndpointForm.initial_for(endpoint)
    )
    if request.method == "POST" and form.is_valid():
        try:
            services.endpoint_update(endpoint=endpoint, **form.service_fields())
        except services.DomainError as exc:
            _apply_refusal(form, exc)
        else:
            return redirect("trusty_portal:endpoint", pk=endpoint.id)
    recent = (
        Delivery.objects.filter(listing__tenant=tenant, listing__endpoint=endpoint)
        .annotate(listed_at=F("listing__created_at"))
        .select_related("event")
        .order_by("-listed_at", "-id")[:10]
    )
    secrets_until = (
        EndpointSecret.objects.filter(endpoint=endpoint, expires_at__gt=timezone.now())
        .order_by("-expires_at")
        .values_list("expires_at", flat=True)
        .first()
    )
    return access.page(
        request,
        "deliveries/portal/endpoint.html",
        {
            "endpoint": endpoint,
            "form": form,
            "rotate": forms.RotateForm(),
            "pause": forms.PauseForm(),
            "recent": recent,
            "previous_secret_until": secrets_until,
            "nav": "endpoints",
        },
    )


def endpoint_action(act):
    """A POST that acts on one of the tenant's endpoints: ``act(request, endpoint)``
    answers, or returns None to go back to the endpoint's page."""

    @access.portal_view
    @wraps(act)
    def view(request, tenant, pk):
        if response := _post_only(request):
            return response
        endpoint = _endpoint(tenant, pk)
        return act(request, endpoint) or redirect("trusty_portal:endpoint", pk=endpoint.id)

    return view


@endpoint_action
def endpoint_test(request, endpoint):
    if not endpoint.enabled:
        return None
    with transaction.atomic():
        event = services.endpoint_send_test(endpoint=endpoint)
        delivery = Delivery.objects.get(event=event)
    return redirect("trusty_portal:delivery", pk=delivery.id)


@endpoint_action
def endpoint_rotate(request, endpoint):
    form = forms.RotateForm(request.POST)
    if not form.is_valid():
        return None
    overlap = timezone.timedelta(hours=form.cleaned_data["overlap_hours"])
    secret = services.endpoint_rotate_secret(endpoint=endpoint, overlap=overlap, via="portal")
    return access.page(
        request,
        "deliveries/portal/secret.html",
        {
            "endpoint": endpoint,
            "secret": secret,
            "overlap_until": timezone.now() + overlap if overlap else None,
            "nav": "endpoints",
        },
    )


@endpoint_action
def endpoint_enable(request, endpoint):
    services.endpoint_enable(endpoint=endpoint, via="portal")


@endpoint_action
def endpoint_pause(request, endpoint):
    form = forms.PauseForm(request.POST)
    reason = form.cleaned_data["reason"] if form.is_valid() else ""
    services.endpoint_pause(endpoint=endpoint, reason=reason, via="portal")


@endpoint_action
def endpoint_resume(request, endpoint):
    services.endpoint_resume(endpoint=endpoint, via="portal")


# --- Deliveries --------------------------------------------------------------------------


@access.portal_view
def deliveries(request, tenant):
    owned = Endpoint.objects.filter(tenant=tenant).order_by("created_at")
    form = forms.DeliveryFilterForm(request.GET or None, endpoints=owned)
    rows = (
        Delivery.objects.filter(listing__tenant=tenant)
        .annotate(listed_at=F("listing__created_at"))
        .select_related("event")
        .order_by("-listed_at", "-id")
    )
    if form.is_bound and form.is_valid():
        data = form.cleaned_data
        if data["state"]:
            rows = rows.filter(state=data["state"])
        if data["endpoint"]:
            rows = rows.filter(listing__endpoint_id=data["endpoint"])
        if data["event_type"]:
            rows = rows.filter(event__event_type=data["event_type"])
        if data["since"]:
            rows = rows.filter(listing__created_at__gte=data["since"])
    elif form.is_bound:
        rows = rows.none()
    before = request.GET.get("before")
    if before:
        try:
            mark = Delivery.objects.filter(
                listing__tenant=tenant, id=access.object_id(before)
            ).values_list("listing__created_at", "id")[0]
        except (Http404, IndexError):
            rows = rows.none()
        else:
            rows = rows.filter(listing__created_at__lte=mark[0]).exclude(
                listing__created_at=mark[0], id__gte=mark[1]
            )
    page = list(rows[: PAGE + 1])
    older = None
    if len(page) > PAGE:
        page = page[:PAGE]
        query = request.GET.copy()
        query["before"] = str(page[-1].id)
        older = f"?{query.urlencode()}"
    return access.page(
        request,
        "deliveries/portal/deliveries.html",
        {
            "form": form,
            "rows": [(d, delivery_explain(d)) for d in page],
            "older": older,
            "urls": {str(e.id): e.url for e in owned},
            "nav": "deliveries",
        },
    )


def _delivery(tenant, pk) -> Delivery:
    delivery = (
        Delivery.objects.filter(listing__tenant=tenant, id=access.object_id(pk))
        .select_related("event")
        .first()
    )
    if delivery is None:
        raise Http404
    return delivery


@access.portal_view
def delivery_detail(request, tenant, pk):
    delivery = _delivery(tenant, pk)
    endpoint = Endpoint.objects.filter(id=delivery.endpoint_id, tenant=tenant).first()
    attempts = Attempt.objects.filter(delivery=delivery).order_by("number")
    return access.page(
        request,
        "deliveries/portal/delivery.html",
        {
            "delivery": delivery,
            "endpoint": endpoint,
            "explanation": delivery_explain(delivery),
            "attempts": [(a, attempt_request_headers(a)) for a in attempts],
            "payload": json.dumps(json.loads(bytes(delivery.event.body)), indent=2)[:20_000],
            "terminal": delivery.state in TERMINAL,
            "nav": "deliveries",
        },
    )


@access.portal_view
def delivery_replay(request, tenant, pk):
    if response := _post_only(request):
        return response
    delivery = _delivery(tenant, pk)
    services.delivery_replay(delivery_ids=[delivery.id], via="portal")
    return redirect("trusty_portal:delivery", pk=delivery.id)


@access.portal_view
def recover(request, tenant):
    owned = Endpoint.objects.filter(tenant=tenant).order_by("created_at")
    form = forms.RecoverForm(request.POST or None, endpoints=owned)
    count = None
    if request.method == "POST" and form.is_valid():
        endpoint_id = form.cleaned_data["endpoint"] or None
        try:
            with transaction.atomic():
                count = services.deliveries_recover(
                    tenant=tenant, since=form.cleaned_data["since"], endpoint_id=endpoint_id
                )
        except services.DomainError as exc:
            form.add_error("since", exc.message)
    return access.page(
        request,
        "deliveries/portal/recover.html",
        {"form": form, "count": count, "nav": "recover"},
    )


# --- The catalogue and the signatures ----------------------------------------------------


@access.portal_view
def catalogue(request, tenant):
    types = EventType.objects.prefetch_related("versions").order_by("name")
    groups: dict[str, list] = {}
    for event_type in types:
        versions = [
            (v, json.dumps(v.schema, indent=2), json.dumps(v.example, indent=2))
            for v in event_type.versions.all()
        ]
        groups.setdefault(group_of(event_type.name), []).append((event_type, versions))
    return access.page(
        request,
        "deliveries/portal/catalogue.html",
        {"groups": sorted(groups.items()), "nav": "catalogue"},
    )


@access.portal_view
def verify(request, tenant):
    return access.page(request, "deliveries/portal/verify.html", {"nav": "verify"})
