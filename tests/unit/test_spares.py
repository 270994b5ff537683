"""Hot spares (spec.spares): the spec, the environment and the planner's rules (spares.py)."""

import pytest

from ddp_operator import crd, names
from ddp_operator.env import trainer_env
from ddp_operator.plan import CREATE, DELETE, PATCH, plan
from ddp_operator.pod import render_trainer_pod
from ddp_operator.spec import SpecError, parse_job

import ddp_builders
from ddp_builders import NOW, job_body, later, make_job, observed, rdzv


def trainer(index, nodes=2, **kw):
    """A trainer pod of a job with spares, told (by its annotation) that `nodes` train."""
    return ddp_builders.trainer(index, annotations={names.NODES_ANNOTATION: str(nodes)}, **kw)

RELEASED_LOG = ("Traceback (most recent call last):\n  ...\n    if result.is_failed():\n"
                "AttributeError: 'NoneType' object has no attribute 'is_failed'\n"
                f"{names.SPARE_RELEASED_MARKER}: rendezvous x-0 was closed while this agent waited as a hot spare")


def _acts(p):
    return sorted((a.verb, a.name) for a in p.actions)


def _running(n=3, **spec):
    """A 2-node job with one spare, everything created and running (n trainer pods)."""
    job = make_job(spares=1, **spec)
    first = plan(job, {}, observed(service_exists=False), NOW)
    return job, plan(job, first.status, observed(rdzv(), *(trainer(i) for i in range(n))), NOW).status


# --- spec -------------------------------------------------------------------------------------------------------
def test_spares_default_to_none_and_parse():
    assert make_job().spec.spares == 0 and make_job().spec.pods == 2
    job = make_job(spares=2)
    assert job.spec.spares == 2 and job.spec.pods == 4 and job.spec.nodes == 2
    assert crd.DEFAULTS["spares"] == 0


@pytest.mark.parametrize("spec, message", [
    ({"spares": -1}, "must be >= 0"),
    ({"spares": names.MAX_SPARES + 1}, f"must be <= {names.MAX_SPARES}"),
    ({"spares": True}, "must be an integer"),
    ({"nodes": names.MAX_NODES, "spares": 1}, f"spec.nodes + spec.spares must be <= {names.MAX_NODES}"),
    ({"spares": 1, "minNodes": 1, "maxNodes": 3}, "needs a fixed-size job"),
    ({"spares": 1, "minNodes": 1}, "needs a fixed-size job"),
])
def test_invalid_spares_name_the_field(spec, message):
    with pytest.raises(SpecError) as e:
        parse_job(job_body(**spec))
    assert e.value.field == "spec.spares" and message in str(e.value)


def test_fixed_range_spelled_out_is_fine():
    assert make_job(spares=1, minNodes=2, maxNodes=2).spec.spares == 1


def test_crd_documents_spares_and_refuses_elastic_jobs_but_not_scaling():
    spec = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    field = spec["properties"]["spares"]
    assert field["default"] == 0 and field["maximum"] == names.MAX_SPARES and "Hot spares" in field["description"]
    messages = " ".join(r["message"] for r in spec["x-kubernetes-validations"])
    assert "spec.spares needs a fixed-size job" in messages
    nodes_rule = next(r for r in spec["x-kubernetes-validations"] if "spec.nodes can only change" in r["message"])
    assert "self.spares > 0" in nodes_rule["rule"] and "or on a job with spec.spares" in nodes_rule["message"]
    assert names.NODES_ANNOTATION in field["description"]
    assert "spec.spares is immutable" in messages


# --- environment ------------------------------------------------------------------------------------------------
def test_spares_use_the_ddpjob_backend_and_a_rendezvous_of_nodes():
    env = {e["name"]: e.get("value") for e in trainer_env(make_job(spares=1), 2, 0)}
    assert env[names.ENV_RDZV_BACKEND] == names.RDZV_BACKEND_SPARES == "ddpjob-c10d"
    assert env[names.ENV_NNODES] == "2:2" and env[names.ENV_POD_INDEX] == "2"
    assert env[names.ENV_NODES_FILE] == f"{names.NODES_DIR}/{names.NODES_FILE}"
    plain = {e["name"]: e.get("value") for e in trainer_env(make_job(), 0, 0)}
    assert plain[names.ENV_RDZV_BACKEND] == "c10d" and names.ENV_NODES_FILE not in plain


def test_spare_pods_carry_the_size_annotation_and_its_file():
    pod = render_trainer_pod(make_job(spares=1), 2, 0)
    assert pod["metadata"]["annotations"][names.NODES_ANNOTATION] == "2"
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == names.NODES_VOLUME]
    (item,) = volume["downwardAPI"]["items"]
    assert item == {"path": names.NODES_FILE,
                    "fieldRef": {"fieldPath": f"metadata.annotations['{names.NODES_ANNOTATION}']"}}
    trainer_c = next(c for c in pod["spec"]["containers"] if c["name"] == names.TRAINER_CONTAINER)
    assert {"name": names.NODES_VOLUME, "mountPath": names.NODES_DIR, "readOnly": True} in trainer_c["volumeMounts"]
    plain = render_trainer_pod(make_job(), 0, 0)
    assert names.NODES_ANNOTATION not in (plain["metadata"].get("annotations") or {})
    assert all(v["name"] != names.NODES_VOLUME for v in plain["spec"]["volumes"])


def test_scaling_a_job_with_spares_patches_every_live_pod_then_adds_one():
    """kubectl scale 2 -> 3: the running pods are told the new size (patch, UID precondition) and a fourth pod is
    created with it; pods already told are left alone, as are pods being deleted."""
    job, status = _running()
    scaled = make_job(spares=1, nodes=3)
    pods = [trainer(0), trainer(1, nodes=3), trainer(2, deleting_since=NOW)]
    p = plan(scaled, status, observed(rdzv(), *pods), later(1))
    patches = [a for a in p.actions if a.verb == PATCH]
    assert [(a.kind, a.name, a.uid) for a in patches] == [("Pod", "mnist-0", "uid-mnist-0-0")]
    assert patches[0].body == {"metadata": {"annotations": {names.NODES_ANNOTATION: "3"}}}
    created = [a for a in p.actions if a.verb == CREATE]
    assert [a.name for a in created] == ["mnist-3"]
    assert created[0].body["metadata"]["annotations"][names.NODES_ANNOTATION] == "3"
    assert p.actions.index(patches[0]) < p.actions.index(created[0])
    assert any(e.reason == names.REASON_SCALED for e in p.events)
    # scale down 3 -> 2: pod 3 is deleted, the others are told 2
    down = plan(job, p.status, observed(rdzv(), *(trainer(i, nodes=3) for i in range(4))), later(2))
    assert _acts(down) == [(DELETE, "mnist-3"), (PATCH, "mnist-0"), (PATCH, "mnist-1"), (PATCH, "mnist-2")]


# --- planner ----------------------------------------------------------------------------------------------------
def test_creates_nodes_plus_spares_pods_and_shows_them():
    job = make_job(spares=1)
    p = plan(job, {}, observed(service_exists=False), NOW)
    assert [a.name for a in p.actions if a.verb == CREATE and a.kind == "Pod"] == \
        ["mnist-rdzv", "mnist-0", "mnist-1", "mnist-2"]
    job, status = _running()
    assert status["phase"] == "Running" and status["nodesReady"] == "2/2 +1"
    assert status["nodes"]["desired"] == 2 and status["nodes"]["running"] == 2 and status["nodes"]["ready"] == 2
    assert status["spares"] == {"desired": 1, "running": 1, "ready": 1}
    assert "(+1/1 spares)" in status["message"]
    two = plan(job, status, observed(rdzv(), trainer(0), trainer(1), trainer(2, phase="Pending")), later(1))
    assert two.status["nodesReady"] == "2/2 +0" and two.status["phase"] == "Running"
    assert make_job().spec.spares == 0 and "spares" not in _plain_status()


def _plain_status():
    job = make_job()
    first = plan(job, {}, observed(service_exists=False), NOW)
    return plan(job, first.status, observed(rdzv(), trainer(0), trainer(1)), NOW).status


def test_a_lost_member_is_counted_once_and_its_pod_recreated_as_the_spare():
    job, status = _running()
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(2), gone=[trainer(1)]), later(5))
    assert _acts(p) == [(CREATE, "mnist-1")] and p.status["infraRestarts"] == 1
    # the spare took the place: two pods run, so training runs; no spare is ready until the new pod is
    assert p.status["nodesReady"] == "2/2 +0"
    back = plan(job, p.status, observed(rdzv(), trainer(0), trainer(2), trainer(1, uid="new")), later(9))
    assert back.status["nodesReady"] == "2/2 +1" and back.status["infraRestarts"] == 1 and back.actions == ()


def test_a_spare_failing_while_it_waits_is_a_failure_like_any_other():
    job, status = _running()
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1),
                                   trainer(2, restart_count=1, last_exit_code=1, last_message="RuntimeError: boom")),
             later(5))
    assert p.status["restarts"] == 1 and p.status["attempts"][-1]["counted"] is True


def test_a_released_spare_is_recorded_never_counted_even_before_the_success_is_seen():
    job, status = _running()
    spare = trainer(2, restart_count=1, last_exit_code=1, last_message=RELEASED_LOG)
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1), spare), later(5))
    assert p.status["restarts"] == 0 and p.status["phase"] == "Running" and p.actions == ()
    assert p.status["attempts"][-1]["reason"] == names.REASON_SPARE_RELEASED
    assert p.status["attempts"][-1]["counted"] is False
    again = plan(job, p.status, observed(rdzv(), trainer(0), trainer(1), spare), later(6))
    assert len(again.status["attempts"]) == 1
    # with restartPolicy Never the pod ends: recorded, not counted
    ended = trainer(2, phase="Failed", exit_code=1, message=RELEASED_LOG, restart_policy="Never")
    q = plan(job, status, observed(rdzv(), trainer(0), trainer(1), ended), later(5))
    assert q.status["restarts"] == 0 and q.status["phase"] == "Running"


def _rank0_finished(members: str):
    """A running job with a spare whose rank 0 (pod 0) exited 0 reporting `members`, the other two pods running."""
    job, status = _running()
    report = '{"rank": 0, "step": 120, "final": true, "members": %s}' % members
    return job, status, plan(job, status, observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0, message=report),
                                                   trainer(1), trainer(2)), later(1))


def test_success_stops_the_spares_at_once_without_counting():
    job, status, p = _rank0_finished("[0, 2]")
    assert (DELETE, "mnist-1") in _acts(p) and (DELETE, "mnist-2") not in _acts(p)
    assert p.status["restarts"] == 0
    # without members named anywhere: once spec.nodes trainers exited 0, the rest are spares
    q = plan(job, status, observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0),
                                   trainer(1, phase="Succeeded", exit_code=0), trainer(2)), later(1))
    assert (DELETE, "mnist-2") in _acts(q)
    done = plan(job, q.status, observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0),
                                        trainer(1, phase="Succeeded", exit_code=0)), later(2))
    assert done.status["phase"] == "Succeeded" and done.status["restarts"] == 0
    # a spare already released (restarting in place) is stopped too, and not counted
    r = plan(job, status, observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0),
                                   trainer(1, phase="Succeeded", exit_code=0),
                                   trainer(2, exit_code=1, message=RELEASED_LOG)), later(1))
    assert (DELETE, "mnist-2") in _acts(r) and r.status["restarts"] == 0 and r.status["phase"] == "Succeeded"


def test_success_with_one_member_still_running_waits_for_it():
    _, _, p = _rank0_finished("[0, 1]")
    assert (DELETE, "mnist-2") in _acts(p) and (DELETE, "mnist-1") not in _acts(p)
    assert p.status["phase"] == "Running"


def test_hang_judges_only_members():
    job, status = _running(failurePolicy={"hangTimeoutSeconds": 20})
    pods = (rdzv(), trainer(0), trainer(1), trainer(2))
    # mnist-1 is the spare: silent (no worker). Members 0 and 2 both at step 41: the tie takes the highest member.
    reports = {"uid-mnist-0-0": {"rank": 0, "step": 41, "members": [0, 2]}, "uid-mnist-1-0": None,
               "uid-mnist-2-0": {"rank": 1, "step": 41, "members": [0, 2]}}
    p = plan(job, status, observed(*pods, hang_reports=reports), later(30))
    assert [(a.verb, a.name) for a in p.actions] == [(DELETE, "mnist-2")]
    # a silent member is the stuck one; the silent spare is left alone
    reports = {"uid-mnist-0-0": {"rank": 0, "step": 41, "members": [0, 1]}, "uid-mnist-1-0": None, "uid-mnist-2-0": None}
    p = plan(job, status, observed(*pods, hang_reports=reports), later(30))
    assert [(a.verb, a.name) for a in p.actions] == [(DELETE, "mnist-1")]
    # nothing names the members: only pods that answered are judged, never a silent one
    reports = {"uid-mnist-0-0": {"rank": 0, "step": 41}, "uid-mnist-1-0": None, "uid-mnist-2-0": {"rank": 1, "step": 40}}
    p = plan(job, status, observed(*pods, hang_reports=reports), later(30))
    assert [(a.verb, a.name) for a in p.actions] == [(DELETE, "mnist-2")]


def test_members_in_progress_status():
    from ddp_operator.status import progress_status
    assert progress_status({"step": 3, "members": [2, 0]})["members"] == [0, 2]
    assert "members" not in progress_status({"step": 3, "members": ["x"]})
    assert "members" not in progress_status({"step": 3, "members": [names.MAX_NODES]})


def test_stale_beyond_nodes_plus_spares():
    job, status = _running()
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1), trainer(2), trainer(3)), later(1))
    assert _acts(p) == [(DELETE, "mnist-3")]


def test_a_vanished_spare_pod_is_counted_like_a_missing_pod():
    job, status = _running()
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1)), later(1))
    assert _acts(p) == [(CREATE, "mnist-2")]
    assert p.status["attempts"][-1]["reason"] == names.REASON_NODE_MISSING


# --- the released marker is only believed where the trainer writes it ---------------------------------------------
# ddpjob-c10d writes it as the log's last line (ddp_trainer.rendezvous_rules._say_released); anywhere else it is a
# log line like any other (a script printing it, a traceback quoting it), and a real failure must still count.
MARKER_IN_THE_MIDDLE = (f"{names.SPARE_RELEASED_MARKER}: rendezvous x-0 was closed while this agent waited\n"
                        "Traceback (most recent call last):\nRuntimeError: CUDA error: an illegal memory access")


@pytest.mark.parametrize("how", ["in-place", "ended"])
def test_the_marker_in_the_middle_of_a_failure_is_still_a_counted_failure(how):
    job, status = _running()
    if how == "in-place":
        pod = trainer(2, restart_count=1, last_exit_code=1, last_message=MARKER_IN_THE_MIDDLE)
    else:
        pod = trainer(2, phase="Failed", exit_code=1, message=MARKER_IN_THE_MIDDLE, restart_policy="Never")
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1), pod), later(5))
    assert p.status["restarts"] == 1 and p.status["attempts"][-1]["counted"] is True
    assert p.status["attempts"][-1]["reason"] != names.REASON_SPARE_RELEASED


@pytest.mark.parametrize("how", ["in-place", "ended"])
def test_the_marker_as_last_line_in_a_job_without_spares_is_a_counted_failure(how):
    job = make_job()
    first = plan(job, {}, observed(service_exists=False), NOW)
    status = plan(job, first.status, observed(rdzv(), ddp_builders.trainer(0), ddp_builders.trainer(1)), NOW).status
    if how == "in-place":
        pod = ddp_builders.trainer(1, restart_count=1, last_exit_code=1, last_message=RELEASED_LOG)
    else:
        pod = ddp_builders.trainer(1, phase="Failed", exit_code=1, message=RELEASED_LOG, restart_policy="Never")
    p = plan(job, status, observed(rdzv(), ddp_builders.trainer(0), pod), later(5))
    assert p.status["restarts"] == 1 and p.status["attempts"][-1]["counted"] is True
    assert p.status["attempts"][-1]["reason"] != names.REASON_SPARE_RELEASED


def test_the_marker_as_last_line_with_spares_is_not_counted_trailing_blank_lines_and_all():
    job, status = _running()
    spare = trainer(2, phase="Failed", exit_code=1, message=RELEASED_LOG + "\n\n", restart_policy="Never")
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1), spare), later(5))
    assert p.status["restarts"] == 0 and p.status["attempts"][-1]["reason"] == names.REASON_SPARE_RELEASED
    assert p.status["attempts"][-1]["counted"] is False
