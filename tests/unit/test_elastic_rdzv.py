"""Elastic jobs close their rendezvous round at the desired size: spec.torchrun.rdzvBackend, the desired-size
annotation and file for elastic jobs, rule 3's settings (ddp_trainer.rendezvous_rules._Size) and a trainer image
without the ddpjob-c10d backend failing the job once, with a reason that says what to do."""

import dataclasses
import types

import pytest

from ddp_operator import crd, names
from ddp_operator.env import trainer_env
from ddp_operator.plan import CREATE, DELETE, PATCH, plan
from ddp_operator.pod import render_trainer_pod
from ddp_operator.spec import SpecError, parse_job
from ddp_trainer.rendezvous_rules import _Size

import ddp_builders
from ddp_builders import NOW, job_body, later, make_job, observed, rdzv

ELASTIC = {"minNodes": 1, "maxNodes": 3}
# torch 2.13's registry (rendezvous/api.py) when the image has no ddp_trainer: the last line of torchrun's log,
# which ends the termination message (FallbackToLogsOnError). Seen: /work/runs/torchrun-missing-backend-output.txt
MISSING = ("Traceback (most recent call last):\n  File \".../torch/distributed/elastic/rendezvous/api.py\", line 372, "
           "in create_handler\n    raise ValueError(\nValueError: The rendezvous backend 'ddpjob-c10d' is not "
           "registered. Did you forget to call `register`?")


def _env(job, index=0):
    return {e["name"]: e.get("value") for e in trainer_env(job, index, 0)}


def trainer(index, nodes=2, **kw):
    return ddp_builders.trainer(index, annotations={names.NODES_ANNOTATION: str(nodes)}, **kw)


def _acts(p):
    return sorted((a.verb, a.name) for a in p.actions)


# --- the backend choice ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, backend", [
    ({}, "c10d"),                                              # fixed size: torch's own
    (ELASTIC, "ddpjob-c10d"),                                  # elastic: closes the round at spec.nodes
    ({"spares": 1}, "ddpjob-c10d"),                            # spares: never livelocks
    ({**ELASTIC, "torchrun": {"rdzvBackend": "c10d"}}, "c10d"),  # an image without ddp_trainer
    ({"torchrun": {"rdzvBackend": "ddpjob-c10d"}}, "ddpjob-c10d"),
    ({"torchrun": {"rdzvBackend": "auto"}}, "c10d"),
])
def test_the_backend_follows_the_job(spec, backend):
    job = make_job(**spec)
    assert _env(job)[names.ENV_RDZV_BACKEND] == backend


def test_rdzv_backend_defaults_to_auto_in_the_crd_and_the_model():
    assert crd.DEFAULTS["torchrun"]["rdzvBackend"] == "auto"
    field = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "torchrun"]["properties"]["rdzvBackend"]
    assert field["enum"] == ["auto", "c10d", "ddpjob-c10d"] and field["default"] == "auto"
    assert "ddp_trainer" in field["description"]
    assert make_job().spec.torchrun.rdzv_backend == "auto"


@pytest.mark.parametrize("spec, message", [
    ({"torchrun": {"rdzvBackend": "static"}}, "must be one of auto, c10d, ddpjob-c10d"),
    ({"spares": 1, "torchrun": {"rdzvBackend": "c10d"}}, "spares need the ddpjob-c10d backend"),
])
def test_a_backend_that_cannot_work_is_refused(spec, message):
    with pytest.raises(SpecError) as e:
        parse_job(job_body(**spec))
    assert e.value.field == "spec.torchrun.rdzvBackend" and message in str(e.value)


def test_admission_refuses_spares_with_c10d():
    rules = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "x-kubernetes-validations"]
    rule = next(r for r in rules if "rdzvBackend" in r["rule"])
    assert rule["rule"] == "!has(self.spares) || self.spares == 0 || !has(self.torchrun) || " \
                           "!has(self.torchrun.rdzvBackend) || self.torchrun.rdzvBackend != 'c10d'"
    assert "spec.spares need" in rule["message"]


# --- the desired size for elastic jobs ----------------------------------------------------------------------------
def test_an_elastic_pod_is_told_the_desired_size():
    job = make_job(nodes=2, **ELASTIC)
    pod = render_trainer_pod(job, 1, 0)
    assert pod["metadata"]["annotations"][names.NODES_ANNOTATION] == "2"
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env[names.ENV_NODES_FILE] == f"{names.NODES_DIR}/{names.NODES_FILE}" and env[names.ENV_NNODES] == "1:3"
    assert {"name": names.NODES_VOLUME, "mountPath": names.NODES_DIR, "readOnly": True} in \
        pod["spec"]["containers"][0]["volumeMounts"]
    assert any(v["name"] == names.NODES_VOLUME for v in pod["spec"]["volumes"])


def test_an_elastic_job_on_c10d_and_a_fixed_job_get_no_size_file():
    for job in (make_job(**ELASTIC, torchrun={"rdzvBackend": "c10d"}), make_job()):
        pod = render_trainer_pod(job, 0, 0)
        assert names.NODES_ANNOTATION not in (pod["metadata"].get("annotations") or {})
        assert names.ENV_NODES_FILE not in _env(job)
        assert not any(v["name"] == names.NODES_VOLUME for v in pod["spec"].get("volumes") or [])


def test_scaling_an_elastic_job_patches_the_pods_then_creates_and_deletes_without_counting():
    """kubectl scale 2 -> 3 of an elastic 1..3 job: the running pods are told 3 before pod 2 is created with it;
    3 -> 2: pod 2 (the highest index) is deleted, never counted, and the survivors are told 2."""
    job = make_job(nodes=2, **ELASTIC)
    first = plan(job, {}, observed(service_exists=False), NOW)
    status = plan(job, first.status, observed(rdzv(), trainer(0), trainer(1)), NOW).status
    up = plan(make_job(nodes=3, **ELASTIC), status, observed(rdzv(), trainer(0), trainer(1)), later(1))
    patches = [a for a in up.actions if a.verb == PATCH]
    assert [a.name for a in patches] == ["mnist-0", "mnist-1"]
    assert patches[0].body == {"metadata": {"annotations": {names.NODES_ANNOTATION: "3"}}}
    created = [a for a in up.actions if a.verb == CREATE]
    assert [a.name for a in created] == ["mnist-2"] and \
        created[0].body["metadata"]["annotations"][names.NODES_ANNOTATION] == "3"
    assert max(up.actions.index(a) for a in patches) < up.actions.index(created[0])

    down = plan(job, up.status, observed(rdzv(), *(trainer(i, nodes=3) for i in range(3))), later(2))
    assert _acts(down) == [(DELETE, "mnist-2"), (PATCH, "mnist-0"), (PATCH, "mnist-1")]
    assert down.status["restarts"] == 0 and down.status["phase"] == "Running"


# --- rule 3: the round's settings ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Settings:
    min_nodes: int
    max_nodes: int


def _size(tmp_path, nnodes, wanted):
    path = tmp_path / "nodes"
    if wanted is not None:
        path.write_text(f"{wanted}\n")
    settings = Settings(*nnodes)
    handler = types.SimpleNamespace(_settings=settings, _op_executor=types.SimpleNamespace(_settings=settings))
    return _Size(handler, str(path)), handler, path


@pytest.mark.parametrize("nnodes, wanted, expected", [
    ((1, 3), 2, (1, 2)),   # elastic: the round closes at the desired size, may still continue with the spec's min
    ((1, 3), 3, (1, 3)),
    ((2, 4), 2, (2, 2)),
    ((2, 2), 3, (3, 3)),   # spares (started fixed): the size is the min and the max
    ((2, 2), 1, (1, 1)),
])
def test_rule_3_settings_follow_the_desired_size(tmp_path, nnodes, wanted, expected):
    size, handler, _ = _size(tmp_path, nnodes, wanted)
    settings = size.follow()
    got = (handler._settings.min_nodes, handler._settings.max_nodes)
    assert got == expected and handler._op_executor._settings == handler._settings
    assert (settings is None) == (expected == nnodes)


def test_rule_3_without_a_size_keeps_the_spec_range(tmp_path):
    size, handler, _ = _size(tmp_path, (1, 3), None)
    assert size.follow() is None and handler._settings == Settings(1, 3)


def test_rule_3_follows_a_changing_size_and_reports_each_change_once(tmp_path):
    size, handler, path = _size(tmp_path, (1, 3), 2)
    assert size.follow() == Settings(1, 2)
    assert size.follow() is None  # unchanged: no re-form
    path.write_text("3\n")
    assert size.follow() == Settings(1, 3)
    path.write_text("2\n")
    assert size.follow() == Settings(1, 2)
    path.write_text("")  # being rewritten: what is in force stays
    assert size.follow() is None and handler._settings == Settings(1, 2)


# --- an image without the backend ----------------------------------------------------------------------------------
def _running_elastic():
    job = make_job(nodes=2, **ELASTIC)
    first = plan(job, {}, observed(service_exists=False), NOW)
    return job, plan(job, first.status, observed(rdzv(), trainer(0), trainer(1)), NOW).status


def _assert_backend_missing(p):
    assert p.status["phase"] == "Failed" and p.status["reason"] == names.REASON_RDZV_BACKEND_MISSING
    assert "pip install ./trainer" in p.status["message"] and "spec.torchrun.rdzvBackend: c10d" in p.status["message"]
    assert "mnist-1" in p.status["message"]
    assert ("Warning", names.REASON_RDZV_BACKEND_MISSING) in [(e.type, e.reason) for e in p.events]


def test_a_missing_backend_fails_the_job_at_its_first_restart():
    job, status = _running_elastic()
    pods = [trainer(0), trainer(1, restart_count=1, last_exit_code=1, last_message=MISSING)]
    p = plan(job, status, observed(rdzv(), *pods), later(1))
    _assert_backend_missing(p)


def test_a_missing_backend_fails_the_job_when_the_pod_ended():
    job, status = _running_elastic()
    pods = [trainer(0), trainer(1, phase="Failed", exit_code=1, message=MISSING, restart_policy="Never")]
    p = plan(job, status, observed(rdzv(), *pods), later(1))
    _assert_backend_missing(p)


def test_the_error_quoted_before_the_last_line_is_an_ordinary_failure():
    job, status = _running_elastic()
    quoted = MISSING + "\nRuntimeError: something else"
    pods = [trainer(0), trainer(1, restart_count=1, last_exit_code=1, last_message=quoted)]
    p = plan(job, status, observed(rdzv(), *pods), later(1))
    assert p.status["phase"] == "Running" and p.status["restarts"] == 1
