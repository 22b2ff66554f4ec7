"""Server-side SVG charts: no JavaScript and no chart library, so a chart renders in the page
(and in every live fragment) exactly as it will look, and is an `img` with a text description."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

Point = tuple[datetime, float]

WIDTH, HEIGHT = 640, 180
LEFT, RIGHT, TOP, BOTTOM = 40, 8, 10, 22


def nice_ceiling(value: float) -> float:
    """The y-axis top: 1, 2 or 5 times a power of ten at or above `value` (at least 1)."""
    if value <= 1:
        return 1
    magnitude = 10 ** (len(str(int(value))) - 1)
    for step in (1, 2, 5, 10):
        if value <= step * magnitude:
            return float(step * magnitude)
    return float(10 * magnitude)


def _n(value: float) -> str:
    return f"{value:.1f}"


def _fmt(value: float) -> str:
    return f"{value:g}" if value < 1000 else f"{value / 1000:g}k"


def line_chart(
    title: str, series: Mapping[str, Sequence[Point]], labels: Mapping[str, str], end: datetime, span: timedelta
) -> SafeString:
    """Lines over the `span` before `end`; `labels` names each series (its CSS class is
    `s-<key>`). The description lists each series' latest value for screen readers."""
    start = end - span
    top = nice_ceiling(max((v for points in series.values() for _, v in points), default=0))
    inner_w, inner_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(at: datetime) -> float:
        return LEFT + inner_w * max(0.0, min(1.0, (at - start) / span))

    def y(value: float) -> float:
        return TOP + inner_h * (1 - value / top)

    grid = format_html_join(
        "",
        '<line class="grid-line" x1="{}" x2="{}" y1="{}" y2="{}"/><text x="{}" y="{}" text-anchor="end">{}</text>',
        (
            (LEFT, WIDTH - RIGHT, _n(y(top * f)), _n(y(top * f)), LEFT - 4, _n(y(top * f) + 4), _fmt(top * f))
            for f in (0, 0.5, 1)
        ),
    )
    minutes = int(span.total_seconds() // 60)
    ticks = format_html_join(
        "",
        '<text x="{}" y="{}" text-anchor="{}">{}</text>',
        (
            (
                _n(x(start + span * f)),
                HEIGHT - 6,
                "start" if f == 0 else "end" if f == 1 else "middle",
                "now" if f == 1 else f"\u2212{round(minutes * (1 - f))} min",
            )
            for f in (0, 0.25, 0.5, 0.75, 1)
        ),
    )
    lines = format_html_join(
        "",
        '<polyline class="s-{}" points="{}"/>',
        (
            (key, " ".join(f"{x(at):.1f},{y(v):.1f}" for at, v in points))
            for key, points in series.items()
            if len(points) > 1
        ),
    )
    dots = format_html_join(
        "",
        '<circle class="s-{}" cx="{}" cy="{}" r="3" fill="currentColor"/>',
        ((key, _n(x(points[0][0])), _n(y(points[0][1]))) for key, points in series.items() if len(points) == 1),
    )
    latest = "; ".join(
        f"{labels[key]} {_fmt(points[-1][1]) if points else 'no data'}" for key, points in series.items()
    )
    count = max((len(points) for points in series.values()), default=0)
    svg = format_html(
        '<svg class="chart" viewBox="0 0 {w} {h}" role="img" aria-label="{title}" data-points="{count}">'
        "<title>{title}</title><desc>{count} samples over the last {minutes} minutes. Latest: {latest}.</desc>"
        '{grid}<line class="axis" x1="{l}" x2="{l}" y1="{t}" y2="{b}"/>{ticks}{lines}{dots}</svg>',
        w=WIDTH,
        h=HEIGHT,
        title=title,
        count=count,
        minutes=minutes,
        latest=latest,
        grid=grid,
        l=LEFT,
        t=TOP,
        b=HEIGHT - BOTTOM,
        ticks=ticks,
        lines=lines,
        dots=dots,
    )
    legend = format_html_join(
        "", '<li class="legend-item s-{}"><span>{}</span></li>', ((key, labels[key]) for key in series)
    )
    return mark_safe(f'<figure class="chart-box">{svg}<ul class="legend">{legend}</ul></figure>')


def sparkline(label: str, values: Sequence[float], css: str) -> SafeString:
    """A tiny line of the last values, labelled with the latest one."""
    if not values:
        return mark_safe('<span class="muted">no history</span>')
    w, h = 120, 28
    top = max(values) or 1
    step = w / max(1, len(values) - 1)
    points = " ".join(f"{i * step:.1f},{h - 2 - (h - 4) * v / top:.1f}" for i, v in enumerate(values))
    if len(values) == 1:
        points = f"0,{h / 2} {w},{h / 2}"
    return format_html(
        '<svg class="spark" viewBox="0 0 {} {}" role="img" aria-label="{}: latest {}, peak {}">'
        '<polyline class="s-{}" points="{}"/></svg>',
        w,
        h,
        label,
        _fmt(values[-1]),
        _fmt(top),
        css,
        points,
    )
