"""The metric history (ddp_operator.history) and its writer (history_keeper): bounded, evenly thinned, cut at a
redone step, hostile documents read as what is valid in them, and written at most every FLUSH_SECONDS as a
read-modify-write that a restarted operator simply continues."""

import json

from ddp_operator import history, names
from ddp_operator.history_keeper import MAX_PENDING, HistoryKeeper
from ddp_operator.jobs import JobRegistry

from fake_api import FakeApi

KEY = ("ml", "job")


def _run(steps, points=None, stride=1):
    points = points or []
    for s in steps:
        points, stride = history.added(points, stride, {"step": s, "loss": 1.0 / (s + 1), "time": float(s)})
    return points, stride


def test_a_long_run_stays_bounded_and_evenly_spaced():
    points, stride = _run(range(0, 20000))
    assert len(points) <= history.MAX_POINTS
    assert points[0]["step"] == 0 and points[-1]["step"] == 19999
    gaps = {b["step"] - a["step"] for a, b in zip(points[1:-1], points[2:-1])}
    assert gaps == {stride}, gaps  # every bucket keeps one point, so the spacing is the stride
    assert len(history.encode(points, stride)) < 64 * 1024


def test_steps_redone_after_a_recovery_replace_the_ones_after_the_restored_step():
    points, stride = _run(range(0, 100))
    points, stride = history.added(points, stride, {"step": 60, "loss": 9.0})
    assert points[-1] == {"step": 60, "loss": 9.0}
    assert all(p["step"] < 60 for p in points[:-1])


def test_a_repeated_report_is_one_point():
    points, stride = _run([5])
    again, _ = history.added(points, stride, {"step": 5, "loss": 1.0 / 6, "time": 5.0})
    assert again == points


def test_points_keep_only_finite_numbers_and_scalar_metrics():
    p = history.point({"step": 3, "loss": float("nan"), "samplesPerSecond": 10, "epoch": True,
                       "metrics": {"acc": 0.5, "hist": [1, 2], "inf": float("inf"), "x" * 100: 1.0}})
    assert p == {"step": 3, "samplesPerSecond": 10.0, "metrics": {"acc": 0.5}}
    assert history.point({"loss": 1.0}) is None and history.point({"step": -1}) is None
    assert history.point({"step": 1, "loss": 10 ** 400}) == {"step": 1}  # no float holds it: left out, no raise


def test_a_hostile_document_reads_as_its_valid_points():
    doc = {"version": 1, "stride": "x", "points": [{"step": 1, "loss": 0.5}, "junk", {"step": 1, "loss": 0.4},
                                                   {"step": 0}, {"step": 7, "loss": "high"}, None]}
    assert history.decode(json.dumps(doc)) == ([{"step": 1, "loss": 0.5}, {"step": 7}], 1)
    for bad in ("", "{", "[]", json.dumps({"version": 2, "points": [{"step": 1}]}), None, 7):
        assert history.decode(bad) == ([], 1)


def test_the_series_shown_ends_with_the_latest_progress_when_it_is_newer():
    points, _ = _run([0, 10])
    assert history.series(points, {"step": 20, "loss": 0.1})[-1] == {"step": 20, "loss": 0.1}
    assert history.series(points, {"step": 10, "loss": 0.1}) == points


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _keeper(api=None):
    jobs, clock = JobRegistry(), Clock()
    api = api or FakeApi({})
    return HistoryKeeper(jobs, api, clock), api, clock


def _stored(api):
    cm = api.config_maps[("ml", names.history_configmap("job"))]
    return history.from_configmap(cm)[0], cm


def test_the_first_point_is_written_at_once_then_at_most_every_flush_interval():
    keeper, api, clock = _keeper()
    keeper.add(KEY, "uid-1", {"step": 1, "loss": 1.0})
    points, cm = _stored(api)
    assert [p["step"] for p in points] == [1]
    assert cm["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    for step in range(2, 6):
        clock.t += 5
        keeper.add(KEY, "uid-1", {"step": step, "loss": 1.0})
    assert [p["step"] for p in _stored(api)[0]] == [1]  # 20 s later: not yet
    clock.t += history.FLUSH_SECONDS
    keeper.add(KEY, "uid-1", {"step": 6, "loss": 1.0})
    assert [p["step"] for p in _stored(api)[0]] == [1, 2, 3, 4, 5, 6]
    keeper.add(KEY, "uid-1", {"step": 7, "loss": 0.5, "final": True}, final=True)
    assert _stored(api)[0][-1]["step"] == 7


def test_a_restarted_operator_continues_the_stored_history():
    keeper, api, clock = _keeper()
    keeper.add(KEY, "uid-1", {"step": 1, "loss": 1.0})
    restarted = HistoryKeeper(JobRegistry(), api, clock)
    restarted.add(KEY, "uid-1", {"step": 2, "loss": 0.9})
    assert [p["step"] for p in _stored(api)[0]] == [1, 2]


def test_an_earlier_jobs_history_is_replaced_and_a_foreign_config_map_left_alone():
    keeper, api, clock = _keeper()
    keeper.add(KEY, "old-uid", {"step": 50, "loss": 1.0})
    keeper.add(KEY, "new-uid", {"step": 1, "loss": 2.0})
    points, cm = _stored(api)
    assert [p["step"] for p in points] == [1] and cm["metadata"]["ownerReferences"][0]["uid"] == "new-uid"
    other = ("ml", "other")
    api.config_maps[("ml", names.history_configmap("other"))] = {"metadata": {"name": "other-history",
                                                                             "resourceVersion": "1"},
                                                                "data": {"mine": "yes"}}
    keeper.add(other, "uid-9", {"step": 1})
    assert api.config_maps[("ml", "other-history")]["data"] == {"mine": "yes"}


def test_a_lost_race_or_an_api_error_keeps_the_points_for_the_next_flush():
    class Failing(FakeApi):
        fail = 2

        def write_config_map(self, body, *, replace):
            if self.fail:
                self.fail -= 1
                if self.fail:
                    raise RuntimeError("apiserver down")
                return False  # 409: someone else wrote first
            return super().write_config_map(body, replace=replace)

    keeper, api, clock = _keeper(Failing({}))
    keeper.add(KEY, "uid-1", {"step": 1})
    clock.t += history.FLUSH_SECONDS
    keeper.add(KEY, "uid-1", {"step": 2})
    assert ("ml", "job-history") not in api.config_maps
    clock.t += history.FLUSH_SECONDS
    keeper.add(KEY, "uid-1", {"step": 3})
    assert [p["step"] for p in _stored(api)[0]] == [1, 2, 3]


def test_pending_points_are_bounded_while_nothing_can_be_written():
    class Down(FakeApi):
        def read_config_map(self, namespace, name):
            raise RuntimeError("apiserver down")

    keeper, api, clock = _keeper(Down({}))
    for step in range(200):
        clock.t += history.FLUSH_SECONDS
        keeper.add(KEY, "uid-1", {"step": step})
    obj = keeper.jobs.record(KEY).of("uid-1")
    assert len(obj.history_pending) == MAX_PENDING and obj.history_pending[-1]["step"] == 199
