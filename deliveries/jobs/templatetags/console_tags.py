"""Template filters of the console's pages: the same rules as its admins
(deliveries.core.console)."""

from django import template

from deliveries.core import console

register = template.Library()


@register.filter
def when(moment):
    """A time with seconds, its zone and how long ago."""
    return console.when(moment)


@register.filter
def percent(fraction):
    """``0.9731`` as ``97.3%`` (``100%`` only when it is whole)."""
    if fraction is None:
        return console.EMPTY
    value = 100 * fraction
    if value == 100:
        return "100%"
    return f"{min(value, 99.9):.1f}%"


@register.filter
def thousands(value):
    """``12345`` as ``12,345``."""
    return f"{value:,}" if isinstance(value, int) else value
