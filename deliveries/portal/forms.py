"""The portal's forms. They shape input only: the rules are the services' (an
endpoint's URL, filter, ceilings: deliveries.services), whose refusals the views show on
the form."""

from datetime import UTC

from django import forms
from django.utils import timezone

from deliveries.core.conf import settings

from ..catalogue import group_of
from ..models import DeliveryState, EventType

OVERLAPS = [
    (0, "No overlap: the old secret stops now"),
    (1, "1 hour"),
    (24, "24 hours"),
    (72, "3 days"),
    (168, "7 days"),
]


def catalogue_choices() -> list[tuple[str, list[tuple[str, str]]]]:
    """The event-type picker: per group, the group's wildcard first, then its types."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for name in EventType.objects.order_by("name").values_list("name", flat=True):
        group = group_of(name)
        choices = groups.setdefault(group, [])
        if group and not choices:
            choices.append((f"{group}.*", f"Every {group} event ({group}.*)"))
        choices.append((name, name))
    return [(group or "Other", choices) for group, choices in sorted(groups.items())]


class UtcDateTimeField(forms.DateTimeField):
    """A time the page labels UTC, read as UTC whatever the host's TIME_ZONE."""

    def to_python(self, value):
        with timezone.override(UTC):
            return super().to_python(value)


def split_types(text: str) -> list[str]:
    return [part.strip() for part in text.replace("\n", ",").split(",") if part.strip()]


class EndpointForm(forms.Form):
    url = forms.URLField(
        label="URL",
        max_length=2000,
        assume_scheme="https",
        help_text="Where we POST the events; https.",
    )
    description = forms.CharField(label="Description", max_length=500, required=False)
    event_types = forms.MultipleChoiceField(
        label="Event types",
        required=False,
        widget=forms.CheckboxSelectMultiple,
        help_text="Tick none to receive every event type.",
    )
    other_event_types = forms.CharField(
        label="Other event types",
        required=False,
        max_length=2000,
        help_text="Names or prefixes with a wildcard (invoice.*), separated by commas.",
    )
    rate_limit = forms.FloatField(
        label="Rate limit (requests per second)",
        required=False,
        min_value=0.01,
        help_text="Empty: no limit of your own.",
    )
    max_concurrency = forms.IntegerField(
        label="Concurrency (requests at once)",
        required=False,
        min_value=1,
        help_text="Empty: the service's ceiling.",
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["event_types"].choices = catalogue_choices()
        self.fields["rate_limit"].validators.append(
            _at_most(settings.DELIVERY_ENDPOINT_RATE_CEILING)
        )
        ceiling = settings.DELIVERY_ENDPOINT_CONCURRENCY_CEILING
        self.fields["max_concurrency"].validators.append(_at_most(ceiling))
        rate = settings.DELIVERY_ENDPOINT_RATE_CEILING
        self.fields["rate_limit"].help_text += f" At most {rate:g}."
        self.fields["max_concurrency"].help_text += f" At most {ceiling}."

    @classmethod
    def initial_for(cls, endpoint) -> dict:
        known = {value for _, choices in catalogue_choices() for value, _ in choices}
        return {
            "url": endpoint.url,
            "description": endpoint.description,
            "event_types": [t for t in endpoint.event_types if t in known],
            "other_event_types": ", ".join(t for t in endpoint.event_types if t not in known),
            "rate_limit": endpoint.rate_limit,
            "max_concurrency": endpoint.max_concurrency,
        }

    def service_fields(self) -> dict:
        data = self.cleaned_data
        types = list(data["event_types"]) + split_types(data["other_event_types"])
        return {
            "url": data["url"],
            "description": data["description"],
            "event_types": list(dict.fromkeys(types)),
            "rate_limit": data["rate_limit"],
            "max_concurrency": data["max_concurrency"],
        }


def _at_most(ceiling):
    from django.core.validators import MaxValueValidator

    return MaxValueValidator(ceiling)


class RotateForm(forms.Form):
    overlap_hours = forms.TypedChoiceField(
        label="Keep the current secret signing for",
        choices=OVERLAPS,
        coerce=int,
        initial=24,
        help_text="Your receiver accepts either secret meanwhile, so it can switch at its pace.",
    )


class PauseForm(forms.Form):
    reason = forms.CharField(
        label="Why (optional)",
        max_length=200,
        required=False,
        help_text="Deliveries wait, none is lost; they flow again when you resume.",
    )


class DeliveryFilterForm(forms.Form):
    state = forms.ChoiceField(
        label="State", required=False, choices=[("", "Any"), *DeliveryState.choices]
    )
    endpoint = forms.ChoiceField(label="Endpoint", required=False)
    event_type = forms.CharField(label="Event type", required=False, max_length=200)
    since = UtcDateTimeField(
        label="Created since (UTC)",
        required=False,
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
    )

    def __init__(self, *args, endpoints=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["endpoint"].choices = [("", "Any")] + [(str(e.id), e.url) for e in endpoints]


class RecoverForm(forms.Form):
    since = UtcDateTimeField(
        label="Failed since (UTC)",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
        help_text="At most 14 days back; up to 10,000 deliveries at a time.",
    )
    endpoint = forms.ChoiceField(label="Endpoint", required=False)

    def __init__(self, *args, endpoints=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["endpoint"].choices = [("", "Every endpoint")] + [
            (str(e.id), e.url) for e in endpoints
        ]


class NotificationForm(forms.Form):
    notification_email = forms.EmailField(
        label="Email for endpoint alerts",
        required=False,
        help_text="We write here when an endpoint is disabled or keeps failing. Empty: no email.",
    )
