"""The README's Measured table and docs/recovery.md's baseline table say what docs/bench/*.json say."""

from __future__ import annotations

import json
import shutil

from tests.benchmarks import report, results


def test_tables_match_the_recorded_results():
    assert report.stale() == [], "run `make bench-report` (tests/benchmarks/report.py --write)"


def test_every_recorded_result_names_its_commit_date_machine_and_mode():
    files = sorted(results.BENCH_DIR.glob("*.json"))
    assert files, "no recorded benchmark results in docs/bench/"
    for path in files:
        doc = json.loads(path.read_text())
        assert doc["benchmark"] == path.stem, path
        assert doc["mode"] in ("full", "quick"), path
        assert doc["commit"] and doc["date"], path
        assert {"cores", "memory_gib", "torch"} <= set(doc["machine"]), path
        assert isinstance(doc["result"], dict), path


def test_a_figure_that_changes_in_a_file_makes_the_tables_stale(tmp_path):
    for path in results.BENCH_DIR.glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    assert report.stale(tmp_path) == []
    path = next(iter(sorted(tmp_path.glob("*.json"))))
    doc = json.loads(path.read_text())
    doc["commit"] = "0" * 40  # shown in the "recorded" column of every table
    path.write_text(json.dumps(doc))
    assert report.stale(tmp_path) != []


def test_a_missing_file_is_shown_as_not_recorded(tmp_path):
    table = report.measured_table(tmp_path)
    assert table.count("not recorded yet") == len(report.ROWS)
    assert "make bench-baselines" in report.baselines_table(tmp_path)


def test_the_fault_table_shows_every_fault_of_faults_json(tmp_path):
    result = {
        "store_loss": {"survived": False, "recovery_s": 21.5, "steps_lost": 27, "resumed_from": "start",
                       "goodput": 0.7125},
        "agent_kill": {"survived": True, "recovery_s": 9.25, "steps_lost": 1, "resumed_from": "local",
                       "goodput": 0.93},
        # recorded before faults.py recorded goodput: no such key, or the job reported none
        "apiserver_restart": {"survived": True, "recovery_s": None, "steps_lost": 0, "resumed_from": None},
        "evict_all": {"survived": True, "recovery_s": 14.1, "steps_lost": 1, "resumed_from": "disk",
                      "goodput": None},
        "all_survived": False, "operator": "helm", "step_delay_s": 0.15,
        "detail": {"node_notready": {"nodes": 1}},
    }
    results.BENCH_DIR, saved = tmp_path, results.BENCH_DIR
    try:
        (tmp_path / "faults.json").write_text(json.dumps(results.envelope("faults", result, "full")))
    finally:
        results.BENCH_DIR = saved
    table = report.faults_table(tmp_path)
    head = [c.strip() for c in table.splitlines()[0].split("|")[4:9]]
    assert head == ["survived", "injection → first resumed step", "steps lost", "resumed from", "goodput"]
    rows = {line.split("|")[1].strip(" `"): [c.strip() for c in line.split("|")[4:9]]
            for line in table.splitlines() if line.startswith("| `")}
    assert list(rows) == [f for f, *_ in report.FAULT_ROWS]
    assert rows["store_loss"] == ["**no**", "21.5 s", "27", "start", "0.7125"]
    assert rows["agent_kill"] == ["yes", "9.25 s", "1", "local", "0.93"]
    assert rows["apiserver_restart"] == ["yes", "—", "0", "not restarted", "—"]
    assert rows["evict_all"] == ["yes", "14.1 s", "1", "disk", "—"]
    assert rows["hang"] == ["not run", "—", "—", "—", "—"]
    assert "3/4 faults survived" in table
    summary = report.faults_summary(json.loads((tmp_path / "faults.json").read_text()))
    assert summary.startswith("3/4 survived (not: store_loss), goodput ≥ 0.7125 (store_loss)"), summary
    assert "make bench-faults" in report.faults_table(tmp_path / "nothing")


def test_every_fault_of_the_benchmark_has_a_row():
    from tests.benchmarks import faults
    assert [f for f, *_ in report.FAULT_ROWS] == faults.FAULTS


def test_the_recorded_faults_table_renders_rows_without_goodput_as_a_dash():
    """docs/bench/faults.json as recorded before faults.py kept goodput: every row still renders."""
    doc = results.load("faults")
    if doc is None:
        return
    table = report.faults_table(results.BENCH_DIR)
    for fault, *_ in report.FAULT_ROWS:
        row = next(line for line in table.splitlines() if line.startswith(f"| `{fault}` |"))
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert len(cells) == 8, row
        goodput = (doc["result"].get(fault) or {}).get("goodput")
        assert cells[-1] == ("—" if goodput is None else f"{goodput:g}"), row
