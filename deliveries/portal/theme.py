"""The host's look for the portal: PORTAL_COLORS as CSS custom properties, served as
``theme.css`` after the portal's own stylesheet (PORTAL_CSS_URL, the host's, comes
last). Colour values are held to a small grammar so that a setting cannot inject CSS
(deliveries.E060)."""

import re

from deliveries.core.conf import settings

# The properties portal.css reads, with its defaults there.
COLOR_NAMES = ("accent", "accent-text", "background", "surface", "text", "muted", "danger", "ok")
_COLOR = re.compile(r"#[0-9a-fA-F]{3,8}|[a-zA-Z]{3,30}|(rgb|rgba|hsl|hsla)\([0-9.,%\s/deg]{1,60}\)")


def color_problems(colors) -> list[str]:
    """What is wrong with a PORTAL_COLORS value, one sentence each."""
    if not isinstance(colors, dict):
        return ["PORTAL_COLORS must be a dict of colour names to CSS colours."]
    problems = []
    for name, value in colors.items():
        if name not in COLOR_NAMES:
            problems.append(f"PORTAL_COLORS: unknown colour {name!r} (known: {COLOR_NAMES}).")
        elif not isinstance(value, str) or not _COLOR.fullmatch(value.strip()):
            problems.append(f"PORTAL_COLORS[{name!r}] is not a CSS colour: {value!r}.")
    return problems


def theme_css() -> str:
    colors = settings.PORTAL_COLORS
    if color_problems(colors):
        return "/* PORTAL_COLORS is not valid: see manage.py check */\n"
    lines = [f"  --portal-{name}: {value.strip()};" for name, value in colors.items()]
    return ":root {\n" + "\n".join(lines) + "\n}\n" if lines else ""
