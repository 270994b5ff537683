"""The drawing half of `kubectl ddp plot`: a job's metric history as a PNG and as a terminal chart.

Pure functions on a list of history points (`ddp_operator.history.point`, in increasing step order, usually
`history.series(points, progress)`); the argument parsing and the cluster access live elsewhere in the plugin.
The PNG carries the exact numbers it draws in a text chunk (`SERIES_KEY`), so a picture passed around keeps its
data and `read_png_series` gets it back without scraping pixels.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

SERIES_KEY = "ddpjob:series"
# Loss only: throughput and metrics such as accuracy read better on a linear axis, and a log axis would hide a
# metric that crosses zero.
_LOG_SERIES = ("loss",)
_INCHES_WIDE = 9.0
_INCHES_PER_SERIES = 2.6
_DPI = 100
_NO_PROGRESS = ("it has reported no progress yet. Plain torchrun scripts report nothing unless they serve "
                "the progress endpoint (GET :29401/progress, as ddp_trainer's Run does; see trainer/README.md)")


def metric_names(points: Sequence[dict]) -> list[str]:
    """The plottable series present: loss, then samplesPerSecond, then the scripts' own metrics by name."""
    fixed = [key for key in ("loss", "samplesPerSecond") if any(key in p for p in points)]
    metrics = sorted({name for p in points for name in (p.get("metrics") or {})})
    return fixed + metrics


def values(points: Sequence[dict], name: str) -> list[tuple[int, float]]:
    """(step, value) of one series, skipping the points that lack it."""
    out = []
    for p in points:
        # A metric may share a fixed key's name; the top-level key is the one the operator documents.
        value = p.get(name) if name in ("loss", "samplesPerSecond") else (p.get("metrics") or {}).get(name)
        if value is not None:
            out.append((int(p["step"]), float(value)))
    return out


def _log_scale(ys: Sequence[float]) -> bool:
    """A log axis only where a linear one would flatten the series: all positive and spanning > two decades."""
    return bool(ys) and min(ys) > 0 and max(ys) / min(ys) > 100.0


def _series(points: Sequence[dict], title: str, names: Sequence[str] | None) -> dict[str, list[tuple[int, float]]]:
    """The non-empty series to draw, in the order asked (metric_names' order by default); ValueError if none."""
    if not points:
        raise ValueError(f"no points to plot for {title}: {_NO_PROGRESS}")
    present = metric_names(points)
    wanted = present if names is None else list(dict.fromkeys(names))
    drawn = {name: values(points, name) for name in wanted}
    drawn = {name: pairs for name, pairs in drawn.items() if pairs}
    if not drawn:
        if not present:
            raise ValueError(f"no points to plot for {title}: its progress reports ({len(points)}) carry a step but "
                             "no loss, throughput or metrics (report them with step_done(loss=, samples=) and "
                             "epoch_done(metrics=), see trainer/README.md)")
        raise ValueError(f"no points to plot for {title}: nothing reported for {', '.join(wanted)}; "
                         f"it reports: {', '.join(present)}")
    return drawn


def write_png(points: Sequence[dict], path: str | Path, *, title: str,
              names: Sequence[str] | None = None) -> list[str]:
    """Draw one subplot per series (loss on top) to a PNG at `path`; returns the series drawn.

    Names asked for that the job never reported are left out (compare the result with `names` to warn); a
    ValueError says why when nothing is left to draw."""
    # Figure + the Agg canvas, never pyplot: no global figure registry, no GUI backend picked from the user's
    # environment, nothing left open between calls. Imported here so the plugin's other commands skip its cost.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    drawn = _series(points, title, names)
    fig = Figure(figsize=(_INCHES_WIDE, _INCHES_PER_SERIES * len(drawn)), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(drawn), 1, sharex=True, squeeze=False)[:, 0]
    fig.suptitle(title)
    for ax, (name, pairs) in zip(axes, drawn.items()):
        xs, ys = [s for s, _ in pairs], [v for _, v in pairs]
        # Markers only while they stay distinct; a long run's hundreds of points would blur into a thick line.
        ax.plot(xs, ys, marker="." if len(pairs) <= 60 else None, linewidth=1.2)
        if name in _LOG_SERIES and _log_scale(ys):
            ax.set_yscale("log")
        ax.set_title(name, loc="left", fontsize="medium")
        ax.grid(True, which="major", alpha=0.4)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    axes[-1].set_xlabel("step")
    data = {"job": title, "series": {name: [[s, v] for s, v in pairs] for name, pairs in drawn.items()}}
    # dpi and the full-figure bbox are explicit so that a user's matplotlibrc (savefig.dpi, savefig.bbox: tight)
    # cannot change the pixel size; ASCII JSON keeps the chunk a plain tEXt one.
    fig.savefig(path, format="png", dpi=_DPI, bbox_inches=fig.bbox_inches,
                metadata={SERIES_KEY: json.dumps(data, separators=(",", ":"))})
    return list(drawn)


def read_png_series(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """The series a `write_png` PNG draws, read back from its text chunk; KeyError if it has none."""
    from PIL import Image

    with Image.open(path) as image:
        text = image.text.get(SERIES_KEY)  # .text reads every text chunk, up to the image data
    if text is None:
        raise KeyError(f"{path} carries no {SERIES_KEY} chunk (not written by kubectl ddp plot)")
    series: dict[str, Any] = json.loads(text)["series"]
    return {name: [(int(s), float(v)) for s, v in pairs] for name, pairs in series.items()}


def _int_ticks(first: int, last: int, count: int = 5) -> list[int]:
    """About `count` whole, round steps (1, 2 or 5 times a power of ten apart); plotext's own ticks would label
    steps 1.25, 1.50, ... and 27.5."""
    if last <= first:
        return [first]
    raw = (last - first) / (count - 1)
    unit = 10 ** max(0, len(str(int(raw))) - 1)
    step = min((m * unit for m in (1, 2, 5, 10)), key=lambda candidate: abs(math.log(candidate / raw)))
    return list(range(-(-first // step) * step, last + 1, step))


def terminal_chart(points: Sequence[dict], *, name: str = "loss", width: int = 80, height: int = 20,
                   color: bool = True) -> str:
    """One series as a plotext chart of `width` x `height` characters (no trailing newline)."""
    import plotext

    pairs = _series(points, "this job", [name])[name]
    xs, ys = [s for s, _ in pairs], [v for _, v in pairs]
    span = f"steps {xs[0]}–{xs[-1]}" if len(xs) > 1 else f"step {xs[0]}"
    plotext.clear_figure()  # plotext is one module-wide figure: whatever a previous call drew is still there
    # Without this plotext shrinks the chart to the terminal it detects (80x25 when stdout is not a terminal).
    plotext.limitsize(False, False)
    plotext.plotsize(width, height)
    plotext.theme("clear")  # no background colors: the user's terminal keeps its own
    plotext.plot(xs, ys)
    if name in _LOG_SERIES and _log_scale(ys):
        plotext.yscale("log")
    ticks = _int_ticks(xs[0], xs[-1], count=max(2, min(6, width // 14)))
    plotext.xticks(ticks, [str(t) for t in ticks])
    plotext.title(f"{name} vs step ({len(xs)} point{'s' if len(xs) != 1 else ''}, {span})")
    plotext.xlabel("step")
    chart = plotext.build()
    plotext.clear_figure()  # and leave no chart of ours behind for a later caller of plotext
    # Even the "clear" theme writes color resets and the line's color, so a pipe or a file needs them stripped.
    chart = chart if color else plotext.uncolorize(chart)
    return chart.rstrip("\n")


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def summary_lines(points: Sequence[dict]) -> list[str]:
    """A few lines printed under the chart: the step range, the loss (first, last, best) and the last throughput."""
    if not points:
        return []
    first, last = points[0]["step"], points[-1]["step"]
    lines = [f"steps {first}–{last} ({len(points)} points)" if len(points) > 1 else f"step {first} (1 point)"]
    loss = values(points, "loss")
    if loss:
        best_step, best = min(loss, key=lambda pair: pair[1])  # the earliest step on a tie
        lines.append(f"loss: first {_fmt(loss[0][1])} (step {loss[0][0]}), last {_fmt(loss[-1][1])} "
                     f"(step {loss[-1][0]}), min {_fmt(best)} at step {best_step}")
    rate = values(points, "samplesPerSecond")
    if rate:
        lines.append(f"samples/s: last {_fmt(rate[-1][1])} (step {rate[-1][0]})")
    return lines
