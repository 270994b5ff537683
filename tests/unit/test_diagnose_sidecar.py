"""The diagnostics sidecar's server (operator/ddp_operator/sidecar/diagnose.py), its pure parts and small wrappers:
stacks -> phase, claimed rank, frames and digest, against real `py-spy dump --json --locals` output of real torchrun
workers (tests/unit/data/diagnose/, captured from the scripts of tests/trainer/test_diagnose_loopback.py: file
`<scenario>_<rank>.json`); /proc parsing; which processes are workers; and hostile input of every kind.
"""

from __future__ import annotations

import ast
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from ddp_operator import names, stall
from ddp_operator.sidecar import diagnose as dg
from ddp_trainer import launch

DATA = Path(__file__).with_name("data") / "diagnose"
HELPER = "_new_process_group_helper (torch/distributed/distributed_c10d.py:2169)"


def raw(name: str) -> list:
    return json.loads((DATA / name).read_bytes())


def threads(name: str):
    return dg.parse_dump((DATA / name).read_bytes())


def proc(pid: int, ppid: int = 1, comm: str = "python3", env: dict | None = None, ticks: int = 250,
         state: str = "S") -> dg.Proc:
    return dg.Proc(pid=pid, ppid=ppid, comm=comm, state=state, cpu_ticks=ticks, env=env or {})


def wenv(rank: int, local: int | None = None, world: int = 2, run: str = "r1") -> dict:
    return {dg.RUN_ID: run, dg.RANK: str(rank), dg.LOCAL_RANK: str(rank if local is None else local),
            dg.WORLD_SIZE: str(world)}


def report(name: str, env: dict, pid: int = 41, comm: str = "python3") -> dict:
    return dg.worker_report(proc(pid, comm=comm, env=env), threads(name), clk_tck=100)


# --- real stacks -----------------------------------------------------------------------------------
def test_a_worker_that_passes_its_local_rank_claims_rank_0_while_it_waits_in_init():
    r = report("wrong_rank_1.json", wenv(1))
    assert len(r.pop("digest")) == 16
    assert r == {"pid": 41, "rank": 0, "envRank": 1, "localRank": 1, "worldSize": 2, "cpuSeconds": 2.5,
                 "phase": "init", "frame": HELPER, "userFrame": "main (train.py:15)"}


def test_a_rank_that_never_joins_runs_its_own_code_while_the_other_waits_in_init():
    r0, r1 = report("never_joins_0.json", wenv(0)), report("never_joins_1.json", wenv(1))
    assert (r0["phase"], r0["rank"], r0["worldSize"], r0["frame"]) == ("init", 0, 2, HELPER)
    assert r0["userFrame"] == "main (train.py:21)"
    # time.sleep is native code: the innermost Python frame is the user's own wait_for_data
    assert (r1["phase"], r1["rank"], r1["frame"], r1["userFrame"]) == \
        ("running", 1, "wait_for_data (train.py:12)", "wait_for_data (train.py:12)")


def test_a_silent_hang_rank_0_waits_in_backwards_all_reduce_rank_1_in_its_loader():
    r0, r1 = report("hangs_0.json", wenv(0)), report("hangs_1.json", wenv(1))
    assert (r0["phase"], r0["frame"], r0["userFrame"]) == \
        ("collective", "_engine_run_backward (torch/autograd/graph.py:979)", "main (train.py:26)")
    assert (r1["phase"], r1["frame"], r1["userFrame"]) == \
        ("running", "load_batch (train.py:12)", "load_batch (train.py:12)")
    assert (r0["rank"], r1["rank"]) == (0, 1)


def test_a_worker_forked_by_ddp_trainer_launch_gets_its_ranks_from_torchs_wrap_frame():
    # forked from a forkserver, its /proc environ is the agent's: RANK and LOCAL_RANK come from the locals of
    # torch's elastic _wrap frame; the launcher's and torch.distributed.elastic's outer frames make it no collective
    r = report("never_joins_forked_1.json", {}, comm=launch.WORKER_NAME)
    assert (r["envRank"], r["localRank"], r["worldSize"], r["rank"]) == (1, 1, 2, 1)
    assert (r["phase"], r["userFrame"]) == ("running", "wait_for_data (train.py:12)")


def _with_frames(name: str, edit) -> list:
    dump = raw(name)
    dump[0]["frames"] = edit(dump[0]["frames"])
    return dg.parse_dump(json.dumps(dump).encode())


def _set_local(frames: list, func: str, local: str, value: str) -> list:
    for f in frames:
        for var in f["locals"] if f["name"] == func else ():
            if var["name"] == local:
                var["repr"] = value
    return frames


def test_the_claim_falls_back_to_init_process_groups_arguments_then_to_the_environment():
    env = wenv(1)
    past_helper = _with_frames("wrong_rank_1.json", lambda fs: fs[1:])  # e.g. still in the rendezvous
    r = dg.worker_report(proc(41, env=env), past_helper, 100)
    assert (r["phase"], r["rank"], r["worldSize"]) == ("init", 0, 2)
    unset = _with_frames("wrong_rank_1.json", lambda fs: _set_local(_set_local(fs[1:], "init_process_group", "rank",
                                                                             "-1"), "init_process_group",
                                                                  "world_size", "-1"))
    r = dg.worker_report(proc(41, env=env), unset, 100)
    assert (r["phase"], r["rank"], r["worldSize"]) == ("init", 1, 2)


def test_a_subgroup_made_after_init_is_a_collective_and_claims_nothing():
    def new_group(fs):
        helper = dict(fs[0], locals=[{"name": "group_rank", "repr": "0"}, {"name": "group_size", "repr": "1"}])
        outer = dict(fs[1], name="new_group", line=5000)
        return [helper, outer, *fs[4:]]
    r = dg.worker_report(proc(41, env=wenv(1)), _with_frames("wrong_rank_1.json", new_group), 100)
    assert (r["phase"], r["rank"], r["worldSize"]) == ("collective", 1, 2)


def test_a_script_still_importing_torch_distributed_is_running_not_in_a_collective():
    """Module code of torch.distributed run by an import at the top of the script: no collective, so no proof that
    the group formed (CI once took such a sample for one and then judged two ranks in init a silent hang)."""
    lib = "/opt/venv/lib/python3.11/site-packages/torch/distributed/"
    frames = (dg.Frame("<module>", lib + "distributed_c10d.py", "torch/distributed/distributed_c10d.py", 40, ()),
              dg.Frame("_call_with_frames_removed", "<frozen importlib._bootstrap>", "<frozen importlib._bootstrap>",
                       241, ()),
              dg.Frame("_find_and_load", "<frozen importlib._bootstrap>", "<frozen importlib._bootstrap>", 1176, ()),
              dg.Frame("<module>", lib + "__init__.py", "torch/distributed/__init__.py", 80, ()),
              dg.Frame("<module>", "/script/train.py", "train.py", 3, ()))
    assert dg.phase(frames) == "running"
    waiting = (dg.Frame("all_reduce", lib + "distributed_c10d.py", "torch/distributed/distributed_c10d.py", 2800, ()),
               dg.Frame("main", "/script/train.py", "train.py", 30, ()))
    assert dg.phase(waiting) == "collective"


def test_the_digest_follows_the_frames_not_their_locals():
    base = report("hangs_1.json", wenv(1))["digest"]
    other_local = _with_frames("hangs_1.json", lambda fs: _set_local(fs, "load_batch", "step", "4"))
    other_line = _with_frames("hangs_1.json", lambda fs: [dict(fs[0], line=13), *fs[1:]])
    assert dg.worker_report(proc(41, env=wenv(1)), other_local, 100)["digest"] == base
    assert dg.worker_report(proc(41, env=wenv(1)), other_line, 100)["digest"] != base
    assert report("hangs_0.json", wenv(0))["digest"] != base


def test_without_stacks_the_environment_and_cpu_still_hold():
    r = dg.worker_report(proc(41, env=wenv(1), ticks=1234), None, 100)
    assert r == {"pid": 41, "rank": 1, "envRank": 1, "localRank": 1, "worldSize": 2, "cpuSeconds": 12.34,
                 "phase": "unknown", "frame": None, "userFrame": None, "digest": None}


# --- hostile input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("out", [b"", b"not json", b"\xff\xfe\x00", b"{}", b"[1, 2]", b'"x"', b"[" * 100_000,
                                 b'[{"frames": "x"}]', b"null"])
def test_py_spy_output_that_is_not_a_dump_is_a_reason_never_an_exception(out):
    with pytest.raises(dg.DumpError) as e:
        dg.parse_dump(out)
    assert str(e.value).startswith("py-spy: ")


def test_frames_with_wrong_types_are_read_as_far_as_they_go():
    dump = [{"pid": "x", "thread_name": 5, "os_thread_id": 41, "active": "yes", "frames": [
        7, {"name": 5, "filename": None, "line": "x", "locals": "x"},
        {"name": "lib", "filename": "/v/site-packages/torch/lib.py", "short_filename": "torch/lib.py", "line": 3,
         "locals": [{"name": "x", "repr": 5}, "junk", {"name": "y", "repr": "\x00" * 5000}]},
        {"name": "step", "filename": "/w/t.py", "short_filename": "t.py", "line": 1e300},
        {"name": "f" * 5000, "filename": "/w/t.py", "short_filename": "t.py", "line": 2}]},
        {"thread_name": "other", "frames": None}]
    ts = dg.parse_dump(json.dumps(dump).encode())
    r = dg.worker_report(proc(41, env={dg.RANK: "x", dg.LOCAL_RANK: "-3", dg.WORLD_SIZE: "9" * 40}), ts, 100)
    assert (r["rank"], r["envRank"], r["localRank"], r["worldSize"]) == (None, None, None, None)
    assert r["phase"] == "running" and r["frame"] == "? (?)" and r["userFrame"] == "step (t.py)"
    assert all(len(v) <= dg.MAX_TEXT for v in r.values() if isinstance(v, str))
    text = dg.format_stacks("Hang", 0.0, [(r, ts, None)])
    assert "y = " in text and "\x00" not in text
    empty = dg.worker_report(proc(41), dg.parse_dump(b'[{"os_thread_id": 41, "frames": []}]'), 100)
    assert (empty["phase"], empty["frame"], empty["digest"]) == ("unknown", None, None)
    assert dg.worker_report(proc(41), [], 100)["phase"] == "unknown"


PERMISSION = (b"Permission Denied: Try running again with elevated permissions by going 'sudo env \"PATH=$PATH\" !!'\n")
GONE = (b"Error: Failed to get process executable name. Check that the process is running.\n\nCaused by:\n"
        b"    0: No such file or directory (os error 2)\n\nStack backtrace:\n   0: <E as anyhow::...>\n")


def test_py_spy_failures_read_as_one_line():
    assert dg.spy_failure(PERMISSION, 1).startswith("py-spy: permission denied (")
    assert dg.spy_failure(b"Error: Operation not permitted (os error 1)\n", 1).startswith("py-spy: permission denied")
    assert dg.spy_failure(GONE, 1) == \
        "py-spy: Failed to get process executable name. Check that the process is running."
    assert dg.spy_failure(b"", 3) == "py-spy: failed (exit 3)"
    assert len(dg.spy_failure(b"x" * 10_000, 1)) <= 210


def _fake_spy(tmp_path: Path, body: str) -> str:
    path = tmp_path / "py-spy"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_running_py_spy_times_out_fails_or_is_missing_with_a_reason(tmp_path):
    assert dg.run_py_spy(_fake_spy(tmp_path, "exec sleep 30"), 1, timeout=0.3) == \
        (None, "py-spy: timed out after 0.3 s")
    assert dg.run_py_spy(_fake_spy(tmp_path, "echo '[{\"frames\": [' ; exit 0"), 1, 5)[1].startswith(
        "py-spy: output is not JSON")
    assert dg.run_py_spy(_fake_spy(tmp_path, "echo 'Permission Denied: x' >&2; exit 1"), 1, 5)[1].startswith(
        "py-spy: permission denied")
    assert dg.run_py_spy(str(tmp_path / "absent"), 1, 5)[1].startswith("py-spy: ")
    assert dg.spy_problem(str(tmp_path / "absent")) == f"py-spy: not found at {tmp_path / 'absent'}"


# --- /proc -----------------------------------------------------------------------------------------
def test_stat_parsing_survives_odd_names_and_truncation():
    fields = " ".join(["S", "7"] + ["0"] * 9 + ["150", "50"] + ["0"] * 30)
    assert dg.parse_stat(f"123 (a) (b) {fields}\n") == dg.Proc(123, 7, "a) (b", "S", 200, {})
    for bad in ["", "123 (x", "123 (x) S", "123 (x) S 7 0 0", "123 (x) S seven" + " 0" * 20]:
        assert dg.parse_stat(bad) is None


def test_stat_of_this_process_matches_its_cpu_time():
    for _ in range(200_000):
        pass
    with open(f"/proc/{os.getpid()}/stat") as f:
        stat = dg.parse_stat(f.read())
    t = os.times()
    assert stat.ppid == os.getppid()
    assert abs(stat.cpu_ticks / os.sysconf("SC_CLK_TCK") - (t.user + t.system)) < 0.1


def test_environ_parsing_keeps_the_ranks_and_drops_garbage():
    env = dg.parse_environ(b"A=1\0RANK=3\0LOCAL_RANK=1\0\0garbage\0TORCHELASTIC_RUN_ID=x\xff\0SECRET=s\0")
    assert env == {"RANK": "3", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x\ufffd"}


def test_workers_are_torchruns_children_not_the_agent_nor_their_own_children():
    procs = {p.pid: p for p in [
        proc(1, 0, "init"),
        proc(10, 1, "torchrun"), proc(11, 10, env=wenv(0)), proc(12, 10, env=wenv(1)),
        proc(13, 11, "pt_data_worker", env=wenv(0)),                    # a DataLoader worker of rank 0
        proc(14, 10, env=wenv(2), state="Z"),                           # a worker that exited
        proc(20, 1, "pt_elastic"), proc(21, 20, "ddp-forkserver"),      # ddp_trainer.launch: forked workers
        proc(22, 21, launch.WORKER_NAME), proc(23, 21, launch.WORKER_NAME),
        proc(24, 22, launch.WORKER_NAME),                               # a forked DataLoader worker
        proc(25, 23, env=wenv(1)),                                      # a spawned one: os.environ has RANK
        proc(30, 1, env={dg.RUN_ID: "r2", dg.RANK: "7", dg.LOCAL_RANK: "0"}),  # an agent whose env looks like one
        proc(31, 30, env=wenv(0, run="r2")), proc(32, 30, env=wenv(1, run="r2")),
        proc(50, 51), proc(51, 50, env=wenv(0)),                        # a parent cycle: /proc read mid-change
    ]}
    assert dg.select_workers(procs, None) == [11, 12, 22, 23, 31, 32, 51]
    assert dg.select_workers(procs, 10) == [11, 12]
    assert dg.select_workers(procs, 20) == [22, 23]
    assert dg.select_workers(procs, 99) == []  # no such process: nothing, and the cycle ends the walk


def test_a_real_child_with_torchruns_environment_is_found_and_read(tmp_path):
    env = dict(os.environ, **wenv(3, local=1, world=4))
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], env=env, stdin=subprocess.PIPE)
    try:
        procs = dg.scan()
        assert dg.select_workers(procs, os.getpid()) == [child.pid]
        assert procs[child.pid].env == {k: v for k, v in wenv(3, local=1, world=4).items()}
    finally:
        child.stdin.close()
        child.wait(10)
    assert dg.read_proc(child.pid) is None  # gone (reaped): nothing to read, no exception


# --- one sample, the cache, the server -------------------------------------------------------------
def test_a_sample_skips_vanished_workers_and_says_why_stacks_are_missing():
    procs = {41: proc(41, env=wenv(0)), 42: proc(42, env=wenv(1)), 43: proc(43, env=wenv(2, world=3))}
    answers = {41: (threads("hangs_0.json"), None), 42: (None, "py-spy: " + GONE.decode().splitlines()[0]),
               43: (None, "py-spy: timed out after 5 s")}
    sample = dg.take_sample("/bin/true", None, scan=lambda: procs, spy=lambda path, pid: answers[pid],
                            read=lambda pid: None if pid == 42 else procs[pid], now=lambda: 7.5)
    assert sample.report["stacks"] == "py-spy: timed out after 5 s" and sample.report["time"] == 7.5
    assert [(w["pid"], w["phase"]) for w in sample.report["workers"]] == [(41, "collective"), (43, "unknown")]
    missing = dg.take_sample("/nonexistent/py-spy", None, scan=lambda: procs, read=procs.get, now=lambda: 1.0)
    assert missing.report["stacks"] == "py-spy: not found at /nonexistent/py-spy"
    assert [w["rank"] for w in missing.report["workers"]] == [0, 1, 2]


def test_an_answer_is_what_the_operator_reads_every_field_valid():
    procs = {41: proc(41, env=wenv(0)), 42: proc(42, comm=launch.WORKER_NAME, ticks=3)}
    files = {41: "hangs_0.json", 42: "never_joins_forked_1.json"}
    sample = dg.take_sample("/bin/true", None, scan=lambda: procs, spy=lambda path, pid: (threads(files[pid]), None),
                            read=procs.get)
    diagnosis, invalid = stall.valid_diagnosis(json.loads(json.dumps(sample.report)))
    assert invalid == ()
    seen = [(w.pid, w.rank, w.env_rank, w.local_rank, w.world_size, w.phase, w.user_frame) for w in diagnosis.workers]
    assert seen == [(41, 0, 0, 0, 2, "collective", "main (train.py:26)"),
                    (42, 1, 1, 1, 2, "running", "wait_for_data (train.py:12)")]


def test_concurrent_probes_share_one_sample_for_a_second():
    calls, clock = [], [100.0]

    def take():
        calls.append(1)
        time.sleep(0.2)
        return len(calls)
    sampler = dg.Sampler(take, max_age=1.0, clock=lambda: clock[0])
    got: list = []
    probes = [threading.Thread(target=lambda: got.append(sampler.get())) for _ in range(4)]
    for t in probes:
        t.start()
    for t in probes:
        t.join()
    assert got == [1, 1, 1, 1]
    clock[0] += 1.5
    assert sampler.get() == 2


def _sample() -> dg.Sample:
    ts = threads("hangs_1.json")
    w = dg.worker_report(proc(42, env=wenv(1)), ts, 100)
    return dg.Sample({"version": 1, "time": 5.0, "stacks": "ok", "workers": [w]}, [(w, ts, None)])


def test_the_server_answers_the_diagnosis_404s_the_rest_and_logs_the_stacks_on_request():
    out = io.StringIO()
    server = dg.Server(("127.0.0.1", 0), dg.Sampler(_sample), out)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    silent = socket.create_connection(server.server_address[:2])  # a client that sends nothing holds nothing
    try:
        with urllib.request.urlopen(base + names.DIAGNOSTICS_PATH, timeout=5) as resp:
            assert json.loads(resp.read())["workers"][0]["userFrame"] == "load_batch (train.py:12)"
        assert out.getvalue() == ""
        with urllib.request.urlopen(base + names.DIAGNOSTICS_PATH + "?log=Process%20Group%0aNever", timeout=5):
            pass
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + "/other", timeout=5)
        assert e.value.code == 404
    finally:
        silent.close()
        server.shutdown()
        server.server_close()
    text = out.getvalue()
    assert text.startswith("=== stacks: Process_Group_Never at 1970-01-01T00:00:05Z (1 worker) ===\n")
    assert "--- worker pid 42: rank 1 (env rank 1, local rank 1) of 2, phase running" in text
    # the script's own locals are never printed (they may hold its secrets)
    assert "    load_batch (train.py:12)\n    main (train.py:" in text and "step = 3" not in text
    assert text.count("=== end of stacks ===") == 1


# --- what it may use -------------------------------------------------------------------------------
def test_it_agrees_with_the_operator_and_the_launcher():
    assert (dg.PORT, dg.PATH) == (names.DIAGNOSTICS_PORT, names.DIAGNOSTICS_PATH)
    assert dg.WORKER_NAME == launch.WORKER_NAME


def test_it_is_python_3_8_and_standard_library_only():
    source = Path(dg.__file__).read_text()
    tree = ast.parse(source, feature_version=(3, 8))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)
