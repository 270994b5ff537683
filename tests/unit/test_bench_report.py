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
