"""What a job's pods may do: torchrun options and PET_* variables the operator owns cannot be set another way,
operator volume names are reserved, and a hardened template yields hardened trainer and store pods."""

import json

import pytest

from ddp_operator import crd, names
from ddp_operator.env import trainer_env
from ddp_operator.pod import render_trainer_pod
from ddp_operator.rdzv import render_rdzv_pod
from ddp_operator.spec import SpecError, parse_job

from ddp_builders import job_body, make_job


def _with_trainer(**container):
    body = job_body()
    body["spec"]["template"]["spec"]["containers"][0].update(container)
    return body


# --- torchrun options -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [
    ["--nproc-per_node=64"], ["--nproc_per-node=64"], ["--nproc_per_node=64"], ["--max_restarts=0"],
    ["--node_rank=0"], ["--master_addr=evil"], ["--master-port=1"], ["--standalone"], ["--local_addr=x"],
    ["--rdzv_timeout=5"], ["--rdzv-read-timeout=5"],
    # `--opt value` spellings: as one item or as two items.
    ["--nproc-per-node 64"], ["--nnodes", "4"],
])
def test_owned_torchrun_options_are_rejected_in_every_spelling(args):
    with pytest.raises(SpecError) as err:
        make_job(torchrun={"extraArgs": args})
    assert err.value.field == "spec.torchrun.extraArgs"


def test_an_option_set_twice_in_two_spellings_is_rejected():
    with pytest.raises(SpecError, match="--log-dir more than once"):
        make_job(torchrun={"extraArgs": ["--log-dir=/a", "--log_dir=/b"]})


def test_other_torchrun_options_pass_in_either_spelling():
    job = make_job(torchrun={"extraArgs": ["--log_dir=/tmp/l", "--redirects=3", "--no-python"]})
    env = {e["name"]: e.get("value") for e in trainer_env(job, 0, 0)}
    assert env["PET_LOG_DIR"] == "/tmp/l" and env["PET_NO_PYTHON"] == "1"


def test_every_option_the_operator_sets_is_reserved():
    """The reserved lists derive from what env.py actually sets: each PET_* it emits is one torchrun must not
    get from the user, and every reserved option maps to exactly one reserved variable."""
    job = make_job(torchrun={"extraArgs": ["--log-dir=/tmp/l"]})
    emitted = {e["name"] for e in trainer_env(job, 0, 0) if e["name"].startswith(names.ENV_PREFIX)}
    assert emitted - {"PET_LOG_DIR"} <= set(names.RESERVED_ENV)
    assert [o.replace("-", "_").upper() for o in names.RESERVED_TORCHRUN_OPTIONS] == \
        [v[len(names.ENV_PREFIX):] for v in names.RESERVED_ENV]


# --- PET_* in the template ------------------------------------------------------------------------------------
# Spelled out (not names.RESERVED_ENV): the test states what must be owned, the code derives its list.
OWNED_ENV = ["PET_NNODES", "PET_NPROC_PER_NODE", "PET_RDZV_BACKEND", "PET_RDZV_ENDPOINT", "PET_RDZV_ID",
             "PET_RDZV_CONF", "PET_LOCAL_ADDR", "PET_MAX_RESTARTS", "PET_NODE_RANK", "PET_MASTER_ADDR",
             "PET_MASTER_PORT", "PET_STANDALONE", "PET_RDZV_TIMEOUT"]


@pytest.mark.parametrize("var", OWNED_ENV)
def test_owned_pet_variable_in_the_trainer_env_is_rejected_by_name(var):
    body = _with_trainer(env=[{"name": "HF_HOME", "value": "/c"}, {"name": var, "value": "1"}])
    with pytest.raises(SpecError) as err:
        parse_job(body)
    assert err.value.field == "spec.template.spec.containers[trainer].env"
    assert var in err.value.message


def test_other_pet_variables_and_other_containers_are_left_alone():
    body = _with_trainer(env=[{"name": "PET_LOG_DIR", "value": "/l"}, {"name": "OMP_NUM_THREADS", "value": "2"}])
    body["spec"]["template"]["spec"]["containers"].append(
        {"name": "sidecar", "image": "x", "env": [{"name": "PET_NNODES", "value": "1"}]})
    pod = render_trainer_pod(parse_job(body), 0, 0)
    trainer = pod["spec"]["containers"][0]
    assert {"name": "PET_LOG_DIR", "value": "/l"} in trainer["env"]
    assert [e["value"] for e in trainer["env"] if e["name"] == "OMP_NUM_THREADS"] == ["2"]


def test_crd_rules_are_built_from_the_same_constants():
    text = json.dumps(crd.build_crd())
    for var in names.RESERVED_ENV:
        assert f"'{var}'" in text
    for option in names.RESERVED_TORCHRUN_OPTIONS:
        assert f"'{option}'" in text
    assert "replace('_', '-')" in text


# --- operator volume names ------------------------------------------------------------------------------------
@pytest.mark.parametrize("volume", ["dshm", "checkpoint"])
def test_template_volume_named_like_an_operator_volume_is_rejected(volume):
    body = job_body(checkpoint={"volume": {"persistentVolumeClaim": {"claimName": "ckpt"}}})
    body["spec"]["template"]["spec"]["volumes"] = [{"name": volume, "emptyDir": {}}]
    with pytest.raises(SpecError) as err:
        parse_job(body)
    assert err.value.field == "spec.template.spec.volumes" and volume in err.value.message


def test_checkpoint_volume_is_the_specs():
    body = job_body(checkpoint={"volume": {"persistentVolumeClaim": {"claimName": "ckpt"}}})
    body["spec"]["template"]["spec"]["volumes"] = [{"name": "data", "emptyDir": {}}]
    volumes = render_trainer_pod(parse_job(body), 0, 0)["spec"]["volumes"]
    assert {"name": names.CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": "ckpt"}} in volumes
    assert [v["name"] for v in volumes].count(names.CHECKPOINT_VOLUME) == 1


# --- credentials and hardening --------------------------------------------------------------------------------
def test_pods_get_no_api_token_unless_the_template_asks():
    job = make_job()
    assert render_trainer_pod(job, 0, 0)["spec"]["automountServiceAccountToken"] is False
    assert render_rdzv_pod(job, 0)["spec"]["automountServiceAccountToken"] is False
    body = job_body()
    body["spec"]["template"]["spec"]["automountServiceAccountToken"] = True
    job = parse_job(body)
    assert render_trainer_pod(job, 0, 0)["spec"]["automountServiceAccountToken"] is True
    # the store never calls the API: no token whatever the trainers need (tests/unit/test_rdzv_hardening.py)
    assert render_rdzv_pod(job, 0)["spec"]["automountServiceAccountToken"] is False


def test_hardened_template_yields_a_hardened_store_pod():
    body = job_body()
    spec = body["spec"]["template"]["spec"]
    spec.update(runtimeClassName="gvisor", hostUsers=False,
                securityContext={"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}})
    spec["containers"][0]["securityContext"] = {
        "allowPrivilegeEscalation": False, "privileged": False, "runAsUser": 1000,
        "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}
    store = render_rdzv_pod(parse_job(body), 0)["spec"]
    assert store["runtimeClassName"] == "gvisor" and store["hostUsers"] is False
    assert store["securityContext"] == spec["securityContext"]
    # Restrictions are copied, grants (capabilities.add for RDMA and the like) are not: the store needs none.
    assert store["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False, "runAsUser": 1000, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
        "readOnlyRootFilesystem": True}
