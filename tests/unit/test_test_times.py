"""hack/test_times.py on a JUnit file as pytest writes it: the failed tests, one line each (what `make test` prints
last when it fails, so that the tail of a CI log names them), and the time tables."""

from __future__ import annotations

from hack import test_times

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.e2e.test_e2e_hang" name="test_frozen" time="73.1"/>
<testcase classname="tests.integration.test_operator" name="test_policy" time="30.4">
<failure message="tests.support.waiting.WaitTimeout: timed out after 30s&#10;second line">trace</failure></testcase>
<testcase classname="tests.e2e.test_e2e_kueue" name="test_queued" time="1.0"><error message="fixture broke">t</error>
</testcase>
<testcase classname="tests.gpu.test_gpu_sample" name="test_cuda" time="0"><skipped message="needs a CUDA device"/>
</testcase></testsuite></testsuites>"""


def test_the_failed_tests_are_named_with_the_first_line_of_why(tmp_path):
    path = tmp_path / "run.xml"
    path.write_text(JUNIT)
    assert test_times.failures([path]) == [
        "tests/integration/test_operator.py::test_policy (failure): tests.support.waiting.WaitTimeout: timed out "
        "after 30s",
        "tests/e2e/test_e2e_kueue.py::test_queued (error): fixture broke"]
    assert test_times.main(["--failures", str(path)]) == 0


def test_time_tables_count_every_outcome(tmp_path, capsys):
    path = tmp_path / "run.xml"
    path.write_text(JUNIT)
    assert test_times.main([str(path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "| tests/e2e | 2 | 74 |" in out and "| tests/e2e/test_e2e_hang.py::test_frozen | 73 | passed |" in out
