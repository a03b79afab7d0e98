"""Charts for the console, drawn on the server as SVG: no script, no library, nothing
fetched from elsewhere. Each chart is one series with its own title and a sentence
describing it (its ``<title>`` and ``<desc>``, read by screen readers), so none is read by
colour alone; the numbers behind it are in a table beside it."""

import math
from datetime import datetime, timedelta

from django.utils import timezone
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

WIDTH, HEIGHT = 960, 130
LEFT, RIGHT, TOP, BOTTOM = 46, 8, 10, 20


def nice_ceiling(value: float) -> float:
    """The round number at or above ``value`` an axis ends at: 1, 2, 2.5 or 5 times a
    power of ten."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * power:
            return step * power
    return 10 * power


def _number(value: float) -> str:
    if value >= 100 or value == int(value):
        return f"{value:,.0f}"
    return f"{value:,.1f}"


def bar_chart(
    values: list[float],
    *,
    start: datetime,
    step: timedelta,
    title: str,
    unit: str,
    bins: int | None = None,
    tick_every: timedelta = timedelta(hours=3),
    css_class: str = "",
    chart_id: str = "chart",
) -> SafeString:
    """Bars over time: ``values[i]`` is the figure of the interval starting at
    ``start + i * step``. With ``bins``, consecutive values are averaged into that many
    bars (each still reads in ``unit``, e.g. per minute). Returns the ``<svg>``."""
    per_bin = max(1, math.ceil(len(values) / bins)) if bins else 1
    bars = [
        sum(values[i : i + per_bin]) / len(values[i : i + per_bin])
        for i in range(0, len(values), per_bin)
    ]
    bar_step = step * per_bin
    top = nice_ceiling(max(bars, default=0))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    width = plot_w / max(len(bars), 1)
    path = []
    for i, value in enumerate(bars):
        if value <= 0:
            continue
        h = max(value / top * plot_h, 1.0)
        x = LEFT + i * width
        path.append(f"M{x:.2f} {TOP + plot_h:.2f}v{-h:.2f}h{max(width - 0.4, 0.6):.2f}v{h:.2f}z")
    ticks = []
    end = start + bar_step * len(bars)
    local_start = timezone.localtime(start)
    first = local_start.replace(minute=0, second=0, microsecond=0)
    hours = int(tick_every.total_seconds() // 3600) or 1
    while first < local_start or first.hour % hours:
        first += timedelta(hours=1)
    tick = first
    while tick <= end:
        x = LEFT + (tick - start) / (end - start) * plot_w
        ticks.append(
            f'<line class="axis" x1="{x:.1f}" y1="{TOP + plot_h}" x2="{x:.1f}" '
            f'y2="{TOP + plot_h + 4}"/><text x="{x:.1f}" y="{HEIGHT - 4}" '
            f'text-anchor="middle">{tick:%H:%M}</text>'
        )
        tick += tick_every
    total = sum(values)
    peak = max(range(len(bars)), key=lambda i: bars[i]) if bars else 0
    peak_at = timezone.localtime(start + bar_step * peak)
    description = (
        f"{_number(total)} in all; the highest bar is {_number(bars[peak])} {unit} at "
        f"{peak_at:%H:%M}."
        if total
        else "None in the window."
    )
    zone = local_start.tzname() or ""
    svg = f"""<svg class="chart {escape(css_class)}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img"
 aria-labelledby="{chart_id}-t {chart_id}-d" data-bars="{len(bars)}"
 data-nonzero="{len(path)}" data-total="{total:g}">
<title id="{chart_id}-t">{escape(title)} ({escape(unit)}, {zone} times)</title>
<desc id="{chart_id}-d">{escape(description)}</desc>
<line class="grid" x1="{LEFT}" y1="{TOP}" x2="{WIDTH - RIGHT}" y2="{TOP}"/>
<line class="grid" x1="{LEFT}" y1="{TOP + plot_h / 2:.1f}" x2="{WIDTH - RIGHT}"
 y2="{TOP + plot_h / 2:.1f}"/>
<text x="{LEFT - 4}" y="{TOP + 4}" text-anchor="end">{_number(top)}</text>
<text x="{LEFT - 4}" y="{TOP + plot_h / 2 + 4:.1f}" text-anchor="end">{_number(top / 2)}</text>
<text x="{LEFT - 4}" y="{TOP + plot_h + 4}" text-anchor="end">0</text>
<path class="bars" d="{" ".join(path)}"/>
<line class="axis" x1="{LEFT}" y1="{TOP + plot_h}" x2="{WIDTH - RIGHT}" y2="{TOP + plot_h}"/>
{"".join(ticks)}
</svg>"""
    return mark_safe(svg)  # noqa: S308 (numbers, and text escaped above)
