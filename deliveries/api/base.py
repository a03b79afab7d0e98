"""What every view of the product's API sets for itself, so that a host's
``REST_FRAMEWORK`` (its own authentication, pagination, parsers, exception handler)
neither changes this API nor is changed by it. DRF fills a view's unset attributes from
the project-wide settings at import, so each is named here."""

import functools
from pathlib import Path

import drf_spectacular
from django.template.backends.django import DjangoTemplates
from django_filters.rest_framework import DjangoFilterBackend
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.settings import patched_settings, spectacular_settings
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework import parsers, permissions, renderers, routers
from rest_framework.negotiation import DefaultContentNegotiation

from .errors import exception_handler
from .parsers import StrictJSONParser


class ProductSchema(AutoSchema):
    """drf-spectacular's AutoSchema for this API's views, which appear in this API's schema
    only: a schema generated under the host's settings (the host's own, drf-spectacular's
    deploy check) leaves them out, as this API's leaves out the host's views."""

    def is_excluded(self):
        ours = product_endpoints_only in spectacular_settings.PREPROCESSING_HOOKS
        return not ours or super().is_excluded()


class ProductAPIView:
    # A mixin for every DRF view of the product: parsing, rendering, filtering, the schema
    # and the one error shape. Authentication and permissions are the views' own (the
    # customer API: a tenant's API key, views.TenantScoped). Comments, not a docstring:
    # drf-spectacular would print a docstring as every operation's description.

    # JSON bodies held to deliveries.core.text (no NUL, no lone surrogates, bounded nesting).
    parser_classes = [StrictJSONParser, parsers.FormParser, parsers.MultiPartParser]
    renderer_classes = [renderers.JSONRenderer, renderers.BrowsableAPIRenderer]
    filter_backends = [DjangoFilterBackend]
    content_negotiation_class = DefaultContentNegotiation
    versioning_class = None
    schema = ProductSchema()

    def get_exception_handler(self):
        return exception_handler


class Public(ProductAPIView):
    # The API root, the schema and its docs page: open to anyone, whatever the host's
    # defaults say.

    authentication_classes = []
    permission_classes = [permissions.AllowAny]
    throttle_classes = []


class ApiRoot(Public, routers.APIRootView):
    schema = None  # a list of links, not an operation (as DRF's own root)


class ApiRouter(routers.DefaultRouter):
    APIRootView = ApiRoot

    def get_api_root_view(self, api_urls=None):
        # The root links the collections, the routes a GET lists: not an action-only
        # route such as portal-link (POST only).
        list_name = self.routes[0].name
        collections = {
            prefix: list_name.format(basename=basename)
            for prefix, viewset, basename in self.registry
            if hasattr(viewset, "list")
        }
        return self.APIRootView.as_view(api_root_dict=collections)


def product_endpoints_only(endpoints):
    """drf-spectacular preprocessing hook: the schema shows this API's routes, not the
    host's own DRF views, wherever the host mounted them."""
    return [e for e in endpoints if issubclass(getattr(e[3], "cls", object), ProductAPIView)]


def extend_schema(**kwargs):
    """drf-spectacular's ``extend_schema`` on a view method, built on ProductSchema
    whatever the host's ``DEFAULT_SCHEMA_CLASS`` (the decorator's default base)."""
    from drf_spectacular.utils import extend_schema as spectacular_extend_schema

    def decorator(f):
        if not hasattr(f, "kwargs") and not hasattr(f, "schema"):
            f.schema = ProductSchema
        elif hasattr(f, "kwargs"):
            f.kwargs.setdefault("schema", ProductSchema)
        return spectacular_extend_schema(**kwargs)(f)

    return decorator


# The schema of this API alone, under this API's own title.
SCHEMA_SETTINGS = {
    "PREPROCESSING_HOOKS": ["deliveries.api.base.product_endpoints_only"],
    # Every operation's error answers, in the one error shape (deliveries.api.errors).
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "deliveries.api.errors.document_errors",
    ],
    # Operation ids and tags from the path after api/ (v1_deliveries_list), wherever the
    # host mounted the API.
    "SCHEMA_PATH_PREFIX": r"/(?:.*/)?api/",
    "TITLE": "Webhooks API",
    "DESCRIPTION": "Endpoints, events and delivery history for one tenant.",
    "VERSION": "1.0.0",
    "ENUM_NAME_OVERRIDES": {
        "OutcomeEnum": "deliveries.models.Outcome",
        "JobStateEnum": "deliveries.jobs.models.JobState",
    },
    # Swagger UI served from this app, not a CDN: /api/docs/ works offline.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
}


class SchemaView(Public, SpectacularAPIView):
    custom_settings = SCHEMA_SETTINGS
    renderer_classes = SpectacularAPIView.renderer_classes

    # Not an operation of the API. drf-spectacular decorates its own view's get() on the
    # host's DEFAULT_SCHEMA_CLASS, which breaks a schema generated under the host's
    # settings (its deploy check among them) when that is DRF's own AutoSchema.
    @extend_schema(exclude=True)
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)


@functools.cache
def _spectacular_templates() -> DjangoTemplates:
    return DjangoTemplates(
        {
            "NAME": "drf_spectacular",
            "DIRS": [Path(drf_spectacular.__file__).parent / "templates"],
            "APP_DIRS": False,
            "OPTIONS": {},
        }
    )


class SpectacularPageRenderer(renderers.TemplateHTMLRenderer):
    """drf-spectacular's page templates, read from its package: the docs page works
    whether or not the host lists drf_spectacular in INSTALLED_APPS (deliveries.apps,
    TRUSTY_APPS, says why the apps do not need it)."""

    def resolve_template(self, template_names):
        (name,) = template_names  # the view's one template_name
        return _spectacular_templates().get_template(name)


class SchemaDocsView(Public, SpectacularSwaggerView):
    renderer_classes = [SpectacularPageRenderer]
    title = SCHEMA_SETTINGS["TITLE"]

    @extend_schema(exclude=True)
    def get(self, request, *args, **kwargs):
        # The page reads drf-spectacular's settings as it answers: this API's, not the
        # host's (Swagger UI from the sidecar, not a CDN).
        with patched_settings(SCHEMA_SETTINGS):
            return super().get(request, *args, **kwargs)
