"""The viewer's charts: curves and scatters drawn by uPlot, histograms and stacked bars as inline SVG.

A curve that one zooms, smooths and reads point by point is a maintained library's job: uPlot
(``viewer/vendor/uplot``, MIT, vendored from npm with its licence) draws each :func:`plot` from the
data the page carries inline (``data-chart``), with real axes (ticks chosen by uPlot from the data's
range, none clipped), drag-to-zoom (double-click resets), a cursor legend and the page's smoothing
slider (an exponential moving average). A page without script shows the same numbers in a table.
Histograms and stacked bars stay small SVG, with several labelled ticks (:func:`ticks`).
"""

from __future__ import annotations

import json
import math
from html import escape
from typing import Sequence

COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000 or abs(value) < 0.01:
        return f"{value:.3g}"
    return f"{value:.2f}".rstrip("0").rstrip(".")


def ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round values from ``lo`` to ``hi`` (steps of 1, 2 or 5 times a power of ten)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    out, v = [], first
    while v <= hi + step * 1e-9:
        out.append(round(v, 12))
        v += step
    return out


def plot(series: dict[str, Sequence[tuple[float, float]]], title: str, *, x_label: str = "step",
         y_label: str = "", scatter: bool = False, chart_id: str = "") -> str:
    """A uPlot chart of one line (or, with ``scatter``, points) per series of ``(x, y)`` points,
    aligned on the union of their x values; the last value of each in the caption."""
    xs = sorted({float(x) for pts in series.values() for x, y in pts if y == y})
    ident = f' id="{escape(chart_id)}"' if chart_id else ""
    head = f'<figure class="chart"{ident}><figcaption>{escape(title)}</figcaption>'
    if not xs:
        return head + '<p class="muted">no values</p></figure>'
    names = [n for n, pts in series.items() if any(y == y for _, y in pts)]
    index = {x: i for i, x in enumerate(xs)}
    columns = []
    for name in names:
        col: list[float | None] = [None] * len(xs)
        for x, y in series[name]:
            if y == y:
                col[index[float(x)]] = float(y)
        columns.append(col)
    spec = {"title": title, "x_label": x_label, "y_label": y_label, "scatter": scatter,
            "names": names, "colors": [COLORS[i % len(COLORS)] for i in range(len(names))], "data": [xs, *columns]}
    last = " ".join(f'<span style="color:{COLORS[i % len(COLORS)]}">■</span> {escape(n)} '
                    f'{_fmt(next(v for v in reversed(c) if v is not None))}' for i, (n, c) in enumerate(zip(names, columns)))
    rows = "".join(f"<tr><td>{_fmt(x)}</td>" + "".join(f"<td>{'' if c[i] is None else _fmt(c[i])}</td>" for c in columns)
                   + "</tr>" for i, x in enumerate(xs[-50:], start=len(xs) - min(len(xs), 50)))
    table = (f"<noscript><table><tr><th>{escape(x_label)}</th>" + "".join(f"<th>{escape(n)}</th>" for n in names)
             + f"</tr>{rows}</table></noscript>")
    return (head + f"<div class=\"uplot-chart\" data-chart='{escape(json.dumps(spec), quote=True)}'></div>"
            + f'<div class="legend">{last}</div>{table}</figure>')


def histogram(values: Sequence[float], title: str, *, bins: int = 12, width: int = 260, height: int = 130) -> str:
    """A histogram of ``values`` with ``bins`` equal bins between their min and max (one bar per
    distinct value when there are at most ``bins`` of them); counts on hover."""
    values = [float(v) for v in values if v == v]
    head = f'<figure class="chart"><figcaption>{escape(title)} <span class="muted">n={len(values)}</span></figcaption>'
    if not values:
        return head + '<p class="muted">no values</p></figure>'
    lo, hi = min(values), max(values)
    distinct = sorted(set(values))
    if len(distinct) <= bins:
        counts = [values.count(v) for v in distinct]
        names = [_fmt(v) for v in distinct]
    else:
        step = (hi - lo) / bins
        counts = [0] * bins
        for v in values:
            counts[min(int((v - lo) / step), bins - 1)] += 1
        names = [f"{_fmt(lo + i * step)}–{_fmt(lo + (i + 1) * step)}" for i in range(bins)]
    top = max(counts)
    pad, base = 4, height - 18
    bar_w = (width - 2 * pad) / len(counts)
    bars = []
    for i, (count, name) in enumerate(zip(counts, names)):
        h = (base - pad) * count / top if top else 0
        x = pad + i * bar_w
        bars.append(f'<rect x="{x:.1f}" y="{base - h:.1f}" width="{max(bar_w - 1, 1):.1f}" height="{h:.1f}" '
                    f'fill="{COLORS[0]}"><title>{escape(name)}: {count}</title></rect>')
    # ticks at round values across the range (not only min and max), each inside the drawing
    span = (hi - lo) or 1.0
    first_x, last_x = pad, width - pad

    def x_of(v: float) -> float:
        if len(distinct) <= bins:  # one bar per value: the tick under its bar
            return pad + (distinct.index(v) + 0.5) * bar_w
        return pad + (width - 2 * pad) * (v - lo) / span

    marks = distinct if len(distinct) <= bins else ticks(lo, hi)
    if len(marks) > 7:
        marks = marks[::math.ceil(len(marks) / 7)]
    axis = "".join(
        f'<line x1="{x_of(v):.1f}" y1="{base}" x2="{x_of(v):.1f}" y2="{base + 3}" class="axis"/>'
        f'<text x="{min(max(x_of(v), first_x), last_x):.1f}" y="{height - 4}" class="tick" '
        f'text-anchor="{"start" if x_of(v) < first_x + 12 else "end" if x_of(v) > last_x - 12 else "middle"}">'
        f'{escape(_fmt(v))}</text>' for v in marks)
    axis += f'<line x1="{pad}" y1="{base}" x2="{width - pad}" y2="{base}" class="axis"/>'
    axis += f'<text x="{pad}" y="10" class="tick">max count {top}</text>' 
    return (head + f'<svg width="{width}" height="{height}" role="img" aria-label="{escape(title)}">'
            + "".join(bars) + axis + "</svg></figure>")


def lines(series: dict[str, Sequence[tuple[float, float]]], title: str, *, x_label: str = "step",
          width: int = 300, height: int = 150) -> str:
    """One line per series of ``(x, y)`` points, x = step; the last value of each in the legend."""
    points = [p for pts in series.values() for p in pts if p[1] == p[1]]
    head = f'<figure class="chart"><figcaption>{escape(title)}</figcaption>'
    if not points:
        return head + '<p class="muted">no values</p></figure>'
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    left, right, top, bottom = 34, 6, 6, 20

    def sx(x: float) -> float:
        return left + (width - left - right) * (x - x0) / (x1 - x0)

    def sy(y: float) -> float:
        return top + (height - top - bottom) * (1 - (y - y0) / (y1 - y0))

    parts = [f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" class="axis"/>',
             f'<text x="{left - 3}" y="{top + 8}" class="tick" text-anchor="end">{_fmt(y1)}</text>',
             f'<text x="{left - 3}" y="{height - bottom}" class="tick" text-anchor="end">{_fmt(y0)}</text>',
             f'<text x="{left}" y="{height - 5}" class="tick">{_fmt(x0)}</text>',
             f'<text x="{width - right}" y="{height - 5}" class="tick" text-anchor="end">{escape(x_label)} {_fmt(x1)}</text>']
    legend = []
    for i, (name, pts) in enumerate(series.items()):
        pts = sorted(p for p in pts if p[1] == p[1])
        if not pts:
            continue
        color = COLORS[i % len(COLORS)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        parts += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2" fill="{color}"><title>{escape(name)} at '
                  f'{escape(x_label)} {_fmt(x)}: {_fmt(y)}</title></circle>' for x, y in pts] if len(pts) <= 60 else []
        legend.append(f'<span style="color:{color}">■</span> {escape(name)} {_fmt(pts[-1][1])}')
    return (head + f'<svg width="{width}" height="{height}" role="img" aria-label="{escape(title)}">'
            + "".join(parts) + f'</svg><div class="legend">{" ".join(legend)}</div></figure>')


def stacked_bars(rows: Sequence[tuple[str, dict[str, float]]], title: str, *, unit: str = "s",
                 width: int = 620, bar_h: int = 14) -> str:
    """One horizontal bar per row, stacked by part (e.g. seconds per phase of each step)."""
    names: list[str] = []
    for _, parts in rows:
        names += [n for n in parts if n not in names]
    head = f'<figure class="chart wide"><figcaption>{escape(title)}</figcaption>'
    if not rows:
        return head + '<p class="muted">no values</p></figure>'
    top = max((sum(max(v, 0.0) for v in parts.values()) for _, parts in rows), default=0.0) or 1.0
    label_w = 70
    height = len(rows) * (bar_h + 3) + 4
    out = []
    for j, (label, parts) in enumerate(rows):
        y = 2 + j * (bar_h + 3)
        out.append(f'<text x="{label_w - 4}" y="{y + bar_h - 3}" class="tick" text-anchor="end">{escape(label)}</text>')
        x = float(label_w)
        for i, name in enumerate(names):
            value = max(parts.get(name, 0.0), 0.0)
            w = (width - label_w - 60) * value / top
            if w > 0:
                out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{COLORS[i % len(COLORS)]}">'
                           f'<title>{escape(label)} {escape(name)}: {_fmt(value)} {unit}</title></rect>')
            x += w
        out.append(f'<text x="{x + 3:.1f}" y="{y + bar_h - 3}" class="tick">{_fmt(sum(parts.values()))} {unit}</text>')
    legend = " ".join(f'<span style="color:{COLORS[i % len(COLORS)]}">■</span> {escape(n)}' for i, n in enumerate(names))
    return (head + f'<svg width="{width}" height="{height}" role="img" aria-label="{escape(title)}">' + "".join(out)
            + f'</svg><div class="legend">{legend}</div></figure>')


def duration(seconds: float | None) -> str:
    """``1 h 02 min``, ``3 min 20 s``, ``12 s``; '–' for none."""
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "–"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    if s >= 60:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s} s"
