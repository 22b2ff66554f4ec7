"""Server-side SVG charts: no JavaScript and no chart library, so a chart renders in the page
(and in every live fragment) exactly as it will look, and is an `img` with a text description."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

Point = tuple[datetime, float]

#: The plot's own coordinates; it is stretched to its box (`preserveAspectRatio="none"`, strokes
#: that do not scale), and the axis labels are HTML around it, so text stays legible at any width.
WIDTH, HEIGHT = 1000, 200
#: The shortest time axis, in samples: a young system's chart spans at least this many.
MIN_SAMPLES = 20


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


def _dot(x: float, y: float) -> str:
    """A lone sample: a zero-length segment, drawn as a dot by its round cap."""
    return f"{x:.1f},{y:.1f} {x + 0.1:.1f},{y:.1f}"


def _fmt(value: float) -> str:
    return f"{value:g}" if value < 1000 else f"{value / 1000:g}k"


def chart_span(series: Mapping[str, Sequence[Point]], end: datetime, longest: timedelta, every_s: float) -> timedelta:
    """The time axis: from the first sample (at least `MIN_SAMPLES` intervals, at most
    `longest`), so a young system's chart is not a sliver at the right edge of an empty hour."""
    first = min((points[0][0] for points in series.values() if points), default=end)
    return max(timedelta(seconds=MIN_SAMPLES * every_s), min(longest, end - first))


def _minutes(span: timedelta) -> str:
    minutes = span.total_seconds() / 60
    return f"{minutes:.0f} min" if minutes >= 1 else f"{span.total_seconds():.0f} s"


def line_chart(
    title: str,
    series: Mapping[str, Sequence[Point]],
    labels: Mapping[str, str],
    end: datetime,
    longest: timedelta,
    every_s: float = 10.0,
) -> SafeString:
    """Lines over the samples (one every `every_s`) up to `end`; `labels` names each series (its
    CSS class is `s-<key>`). The description lists each series' latest value for screen readers."""
    span = chart_span(series, end, longest, every_s)
    start = end - span
    top = nice_ceiling(max((v for points in series.values() for _, v in points), default=0))

    def x(at: datetime) -> float:
        return WIDTH * max(0.0, min(1.0, (at - start) / span))

    def y(value: float) -> float:
        return 2 + (HEIGHT - 4) * (1 - value / top)

    grid = format_html_join(
        "",
        '<line class="grid-line" x1="0" x2="{}" y1="{}" y2="{}"/>',
        ((WIDTH, _n(y(top * f)), _n(y(top * f))) for f in (0, 0.5, 1)),
    )
    lines = format_html_join(
        "",
        '<polyline class="s-{}{}" points="{}"/>',
        (
            (key, "", " ".join(f"{x(at):.1f},{y(v):.1f}" for at, v in points))
            if len(points) > 1
            else (key, " dot", _dot(x(points[0][0]), y(points[0][1])))
            for key, points in series.items()
            if points
        ),
    )
    latest = "; ".join(
        f"{labels[key]} {_fmt(points[-1][1]) if points else 'no data'}" for key, points in series.items()
    )
    count = max((len(points) for points in series.values()), default=0)
    y_labels = format_html_join("", "<span>{}</span>", ((_fmt(top * f),) for f in (1, 0.5, 0)))
    x_labels = format_html_join(
        "",
        "<span>{}</span>",
        (("now" if f == 1 else f"\u2212{_minutes(span * (1 - f))}",) for f in (0, 0.5, 1)),
    )
    legend = format_html_join(
        "", '<li class="legend-item s-{}"><span>{}</span></li>', ((key, labels[key]) for key in series)
    )
    empty = "" if count else '<p class="chart-empty muted">No samples yet: the poller writes one per interval.</p>'
    return format_html(
        '<figure class="chart-box"><div class="chart-plot"><div class="y-labels" aria-hidden="true">{y_labels}</div>'
        '<svg class="chart" viewBox="0 0 {w} {h}" preserveAspectRatio="none" role="img" aria-label="{title}"'
        ' data-points="{count}"><title>{title}</title><desc>{count} samples over the last {span}. Latest: {latest}.'
        "</desc>{grid}{lines}</svg></div>"
        '<div class="x-labels" aria-hidden="true">{x_labels}</div>{empty}<ul class="legend">{legend}</ul></figure>',
        y_labels=y_labels,
        w=WIDTH,
        h=HEIGHT,
        title=title,
        count=count,
        span=_minutes(span),
        latest=latest,
        grid=grid,
        lines=lines,
        x_labels=x_labels,
        empty=mark_safe(empty),
        legend=legend,
    )


def sparkline(label: str, values: Sequence[float], css: str) -> SafeString:
    """A tiny line of the last values, labelled with the latest one."""
    if not values:
        return mark_safe('<span class="muted">no history</span>')
    w, h = 120, 28
    top = max(values) or 1
    step = w / max(1, len(values) - 1)
    points = " ".join(f"{i * step:.1f},{h - 2 - (h - 4) * v / top:.1f}" for i, v in enumerate(values))
    if len(values) == 1 or (min(values) == max(values) and values[0]):
        points = f"0,{h / 2} {w},{h / 2}"  # a steady non-zero value: a level line mid-height
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
