"""`kubectl ddp run`'s pure parts: what travels in the script's ConfigMap (and what cannot), the DDPJob it creates
(valid against the CRD's schema), the job's name, and the lines announced while following."""

import base64
import threading
import time

import jsonschema
import pytest

from ddp_operator import crd, names
from kubectl_ddp import run
from kubectl_ddp.kube import CliError
from kubectl_ddp.main import parse_args


def test_a_directory_travels_without_caches_and_with_paths_kept(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "train.py").write_text("import pkg.model\n")
    (tmp_path / "pkg" / "model.py").write_text("X = 1\n")
    (tmp_path / "pkg" / "weights.bin").write_bytes(b"\xff\x00\x01")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"x")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref")
    files = run.script_files(tmp_path)
    assert sorted(rel for rel, _ in files.values()) == ["pkg/model.py", "pkg/weights.bin", "train.py"]
    cm = run.script_config_map("j-script", "j", files)
    key = next(k for k, (rel, _) in files.items() if rel == "pkg/weights.bin")
    assert base64.b64decode(cm["binaryData"][key]) == b"\xff\x00\x01" and key not in cm["data"]
    assert all(set(k) <= set("-._abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") for k in files)


def test_too_much_for_a_config_map_says_to_bake_an_image(tmp_path):
    (tmp_path / "data.bin").write_bytes(b"0" * (run.MAX_SCRIPT_BYTES + 1))
    (tmp_path / "train.py").write_text("pass\n")
    with pytest.raises(CliError, match="bake the code into an image"):
        run.script_files(tmp_path)
    for i in range(run.MAX_FILES + 1):
        (tmp_path / f"f{i}.py").write_text("")
    with pytest.raises(CliError, match="more than a ConfigMap should carry"):
        run.script_files(tmp_path)
    with pytest.raises(CliError, match="no such file"):
        run.script_files(tmp_path / "missing.py")


def _schema():
    return crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_the_job_is_valid_against_the_crd_and_runs_the_script_with_its_arguments(tmp_path):
    (tmp_path / "train.py").write_text("pass\n")
    files = run.script_files(tmp_path / "train.py")
    body = run.job_manifest("train-abcde", entry="train.py", args=["--epochs", "3"], files=files, nodes=2,
                            nproc_per_node="auto", spares=1, image="img:1", cpu="1", memory="2Gi",
                            checkpoint_claim="train-abcde-checkpoint", progress_period=5, backoff_limit=0,
                            max_restarts=2)
    jsonschema.validate(body, _schema())
    spec = body["spec"]
    trainer = spec["template"]["spec"]["containers"][0]
    assert trainer["command"] == ["torchrun", "train.py", "--epochs", "3"] and trainer["workingDir"] == run.SCRIPT_DIR
    assert spec["nprocPerNode"] == "auto" and spec["spares"] == 1
    assert spec["failurePolicy"] == {"backoffLimit": 0} and spec["torchrun"] == {"maxRestarts": 2}
    assert spec["checkpoint"]["volume"] == {"persistentVolumeClaim": {"claimName": "train-abcde-checkpoint"}}
    volume = next(v for v in spec["template"]["spec"]["volumes"] if v["name"] == run.SCRIPT_VOLUME)
    assert volume["configMap"] == {"name": "train-abcde-script", "items": [{"key": "train.py", "path": "train.py"}]}
    plain = run.job_manifest("t", entry="t.py", args=[], files=files, nodes=1, nproc_per_node="1", spares=0,
                             image="img:1", cpu="1", memory="1Gi", checkpoint_claim=None, progress_period=5)
    assert {"spares", "failurePolicy", "torchrun", "checkpoint"}.isdisjoint(plain["spec"])
    claim = run.checkpoint_claim("t-checkpoint", "10Gi", None)
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "10Gi"}}}


def test_names_are_dns_labels_that_fit_and_differ_per_run(tmp_path):
    a = run.job_name(tmp_path / "My_Train Script.v2.py", None)
    b = run.job_name(tmp_path / "My_Train Script.v2.py", None)
    assert a != b and a.startswith("my-train-script-v2-")
    long = run.job_name(tmp_path / ("9" + "x" * 100 + ".py"), None)
    assert long[0].isalpha() and len(long) <= names.MAX_NAME_LENGTH
    assert run.job_name(tmp_path / "t.py", "given") == "given"


def test_script_arguments_after_the_double_dash_are_the_scripts():
    args = parse_args(["run", "train.py", "--nodes", "2", "-n", "ml", "--", "--nodes", "9", "-n", "x"])
    assert (args.nodes, args.namespace, args.args) == (2, "ml", ["--nodes", "9", "-n", "x"])
    assert parse_args(["run", "train.py"]).args == [] and parse_args(["run", "t.py", "-d"]).detach


def test_incidents_recoveries_and_phases_are_announced_once_each():
    seen = {}
    assert run.announcements(seen, {"phase": "Pending"}) == ["> Pending"]
    assert run.announcements(seen, {"phase": "Pending"}) == []
    status = {"phase": "Restarting", "message": "1/2 running", "lastIncident": {"reason": "NodeFailed", "time": "t1"}}
    assert run.announcements(seen, status) == ["! incident: NodeFailed at t1; recovering", "> Restarting: 1/2 running"]
    status = {**status, "phase": "Running", "message": "",
              "lastRecovery": {"fault": "NodeFailed", "resumedFrom": "peer", "restoredFromPod": "j-0",
                               "stepsLost": 0, "seconds": 4.2}}
    assert run.announcements(seen, status) == [
        "! recovered from NodeFailed, resumed from peer (j-0), 0 steps lost, 4.2 s", "> Running"]
    assert run.announcements(seen, status) == []
    # Attached to a job that already had a recovery: nothing old is announced.
    assert run.announcements({}, status) == ["> Running"]


def test_the_log_writer_prints_nothing_once_closed_and_close_waits_for_a_line_being_printed():
    """Ctrl-C: the log streamer (a daemon thread) must not be printing while the interpreter shuts down (it aborts
    with exit 134): `close` returns only after a line in progress is out, and every later line is dropped."""
    printed, printing = [], threading.Event()

    class SlowConsole:
        def print(self, text, **_):
            printing.set()
            time.sleep(0.3)
            printed.append(str(text))

    writer = run._ConsoleLines(SlowConsole())
    streamer = threading.Thread(target=writer.write, args=("one\ntwo\n",), daemon=True)
    streamer.start()
    assert printing.wait(5)
    writer.close()
    assert printed == ["one", "two"]  # the lines being printed when close was called are out before it returned
    writer.write("three\n")
    assert printed == ["one", "two"]
    streamer.join(5)
