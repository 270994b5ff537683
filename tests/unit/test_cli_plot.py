"""kubectl_ddp.plot: the series it picks, the PNG it writes (pixel size, the numbers embedded in it) and the terminal
chart (plotext's global figure, escape codes, size)."""

from __future__ import annotations

import re

import matplotlib
import plotext
import pytest
from PIL import Image

from ddp_operator import history
from kubectl_ddp import plot

ANSI = re.compile(r"\x1b\[")


def _points() -> list[dict]:
    """A history as the operator keeps it: points built by history.point, some fields missing on some points."""
    raw = [
        {"step": 0, "loss": 2.3, "samplesPerSecond": 400.0, "metrics": {"valLoss": 2.4}},
        {"step": 10, "loss": 1.1, "metrics": {"valAccuracy": 0.5}},
        {"step": 20, "samplesPerSecond": 410.5},
        {"step": 30, "loss": 0.1 + 0.2, "samplesPerSecond": 420.25, "metrics": {"valAccuracy": 0.75, "valLoss": 0.9}},
    ]
    return [history.point(p) for p in raw]


def test_metric_names_put_loss_then_throughput_then_metrics_sorted():
    assert plot.metric_names(_points()) == ["loss", "samplesPerSecond", "valAccuracy", "valLoss"]
    assert plot.metric_names([{"step": 1, "metrics": {"b": 1.0, "a": 2.0}}, {"step": 2, "samplesPerSecond": 3.0}]) \
        == ["samplesPerSecond", "a", "b"]
    assert plot.metric_names([{"step": 1}]) == []


def test_values_skip_points_without_the_series():
    points = _points()
    assert plot.values(points, "loss") == [(0, 2.3), (10, 1.1), (30, 0.1 + 0.2)]
    assert plot.values(points, "samplesPerSecond") == [(0, 400.0), (20, 410.5), (30, 420.25)]
    assert plot.values(points, "valAccuracy") == [(10, 0.5), (30, 0.75)]
    assert plot.values(points, "missing") == []


@pytest.mark.parametrize("ys, log", [
    ([10.0, 1.0, 0.05], True),     # more than two decades, all positive
    ([2.3, 1.0, 0.5], False),      # well under a decade
    ([100.0, 1.0], False),         # exactly two decades is not more than two
    ([1000.0, 0.0, 0.001], False),  # a zero has no logarithm
    ([5.0, -1.0, 0.001], False),
    ([], False),
])
def test_log_scale_only_where_a_linear_axis_would_flatten_the_series(ys, log):
    assert plot._log_scale(ys) is log


def test_png_has_one_panel_per_series_and_carries_the_exact_numbers(tmp_path):
    path = tmp_path / "job.png"
    drawn = plot.write_png(_points(), path, title="team-a/mnist")
    assert drawn == ["loss", "samplesPerSecond", "valAccuracy", "valLoss"]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.size == (900, 4 * 260)  # 9 x 2.6 inches per series at 100 dpi
    series = plot.read_png_series(path)
    assert list(series) == drawn
    for name in drawn:
        assert series[name] == plot.values(_points(), name)
    assert series["loss"][-1] == (30, 0.30000000000000004)  # floats survive the text chunk bit for bit


def test_png_draws_the_names_asked_in_their_order_and_leaves_out_the_unreported(tmp_path):
    path = tmp_path / "job.png"
    drawn = plot.write_png(_points(), path, title="j", names=["valLoss", "nope", "loss"])
    assert drawn == ["valLoss", "loss"]
    assert list(plot.read_png_series(path)) == ["valLoss", "loss"]
    with Image.open(path) as image:
        assert image.size == (900, 2 * 260)


def test_png_pixel_size_holds_under_a_users_tight_bbox_setting(tmp_path):
    path = tmp_path / "job.png"
    with matplotlib.rc_context({"savefig.bbox": "tight", "savefig.dpi": 300}):
        plot.write_png(_points(), path, title="j", names=["loss"])
    with Image.open(path) as image:
        assert image.size == (900, 260)


@pytest.mark.parametrize("points, said", [
    ([], "no progress yet"),
    ([{"step": 5}, {"step": 6}], "carry a step but no loss"),
])
def test_nothing_to_draw_is_a_value_error_that_says_why(tmp_path, points, said):
    with pytest.raises(ValueError, match="no points to plot") as err:
        plot.write_png(points, tmp_path / "x.png", title="team-a/mnist")
    assert said in str(err.value) and "team-a/mnist" in str(err.value)
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(ValueError, match="no points to plot"):
        plot.terminal_chart(points)


def test_asking_only_for_unreported_series_names_the_reported_ones(tmp_path):
    with pytest.raises(ValueError, match="it reports: loss, samplesPerSecond, valAccuracy, valLoss"):
        plot.write_png(_points(), tmp_path / "x.png", title="j", names=["accuracy"])
    with pytest.raises(ValueError, match="nothing reported for accuracy"):
        plot.terminal_chart(_points(), name="accuracy")


def test_read_png_series_refuses_a_png_it_did_not_write(tmp_path):
    path = tmp_path / "other.png"
    Image.new("RGB", (4, 4)).save(path)
    with pytest.raises(KeyError, match="ddpjob:series"):
        plot.read_png_series(path)


def test_terminal_chart_without_color_is_plain_text_of_the_size_asked():
    chart = plot.terminal_chart(_points(), width=120, height=18, color=False)
    assert not ANSI.search(chart)
    lines = chart.split("\n")
    assert "loss vs step (3 points, steps 0–30)" in lines[0]
    # Exactly the size asked, even past the 80 columns plotext assumes when stdout is not a terminal.
    assert len(lines) == 18
    assert {len(line) for line in lines} == {120}
    assert "step" in lines[-1]


def test_terminal_chart_with_color_keeps_plotexts_escape_codes():
    chart = plot.terminal_chart(_points(), width=60, height=12, color=True)
    assert ANSI.search(chart)
    assert re.sub(r"\x1b\[[0-9;]*m", "", chart) == plot.terminal_chart(_points(), width=60, height=12, color=False)


def test_terminal_chart_forgets_the_previous_figure():
    plotext.clear_figure()
    alone = plot.terminal_chart(_points(), name="valAccuracy", width=70, height=14, color=False)
    # Whatever else in the process drew on plotext's one global figure last.
    plotext.plot([0, 500], [-7.0, 90.0])
    plotext.title("stale")
    plot.terminal_chart(_points(), name="loss", width=40, height=30, color=False)
    plotext.plot([0, 500], [-7.0, 90.0])
    after = plot.terminal_chart(_points(), name="valAccuracy", width=70, height=14, color=False)
    assert after == alone
    assert "valAccuracy vs step (2 points, steps 10–30)" in after and "loss" not in after and "stale" not in after


def test_terminal_chart_labels_whole_steps():
    points = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 4.0}]
    chart = plot.terminal_chart(points, width=80, height=12, color=False)
    tick_line = chart.split("\n")[-2]
    assert tick_line.split() == ["1", "2"]
    assert "1.25" not in chart
    assert "(2 points, steps 1–2)" in chart
    assert "(1 point, step 7)" in plot.terminal_chart([{"step": 7, "loss": 1.0}], color=False)


@pytest.mark.parametrize("first, last, count, ticks", [
    (0, 110, 6, [0, 20, 40, 60, 80, 100]),
    (1, 2, 6, [1, 2]),
    (5, 5, 6, [5]),
    (37, 123456, 6, [20000, 40000, 60000, 80000, 100000, 120000]),
    (0, 7, 2, [0, 5]),
])
def test_int_ticks_are_round_whole_steps_inside_the_range(first, last, count, ticks):
    assert plot._int_ticks(first, last, count) == ticks


def test_summary_names_the_range_the_loss_minimum_and_the_last_throughput():
    points = [history.point(p) for p in [
        {"step": 100, "loss": 2.0, "samplesPerSecond": 300.0},
        {"step": 200, "loss": 0.5},
        {"step": 300, "loss": 0.75, "samplesPerSecond": 310.5},
        {"step": 400},
    ]]
    assert plot.summary_lines(points) == [
        "steps 100–400 (4 points)",
        "loss: first 2 (step 100), last 0.75 (step 300), min 0.5 at step 200",
        "samples/s: last 310.5 (step 300)",
    ]
    assert plot.summary_lines([{"step": 3}]) == ["step 3 (1 point)"]
    assert plot.summary_lines([]) == []
