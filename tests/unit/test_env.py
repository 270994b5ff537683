"""The operator -> trainer environment contract (docs/contract.md)."""

from ddp_operator import names
from ddp_operator.env import extra_arg_env, merge_env, trainer_env

from ddp_builders import make_job


def _env(job, index=0, group=0):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in trainer_env(job, index, group)}


def test_contract_variables():
    env = _env(make_job(nodes=3, minNodes=2, maxNodes=4), index=1, group=2)
    assert env == {
        "PET_NNODES": "2:4",
        "PET_NPROC_PER_NODE": "1",
        "PET_RDZV_BACKEND": "ddpjob-c10d",  # elastic: the round closes at spec.nodes (env.rdzv_backend)
        "PET_RDZV_ENDPOINT": "mnist-rdzv.mnist.ml.svc.cluster.local:29400",
        "PET_RDZV_ID": "0b5c-uid-2",
        "PET_RDZV_CONF": "is_host=0,join_timeout=600,last_call_timeout=10,keep_alive_interval=1,"
                         "keep_alive_max_attempt=3",
        "PET_LOCAL_ADDR": {"fieldRef": {"fieldPath": "status.podIP"}},
        "PET_MAX_RESTARTS": "10",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "DDPJOB_NAME": "mnist",
        "DDPJOB_NAMESPACE": "ml",
        "DDPJOB_POD_INDEX": "1",
        "DDPJOB_NODES_FILE": "/etc/ddpjob/nodes",
        "DDPJOB_SNAPSHOT_DIR": "/dev/shm/ddpjob",
        "DDPJOB_PROGRESS_PORT": "29401",
    }


def test_rendezvous_id_never_none():
    assert _env(make_job())["PET_RDZV_ID"] != "none"


def test_checkpoint_dir_only_with_checkpoint():
    job = make_job(checkpoint={"volume": {"emptyDir": {}}, "mountPath": "/ckpt"})
    assert _env(job)[names.ENV_CHECKPOINT_DIR] == "/ckpt"
    assert names.ENV_CHECKPOINT_DIR not in _env(make_job())


def test_extra_args_become_pet_variables():
    assert extra_arg_env("--log-dir=/x") == ("PET_LOG_DIR", "/x")
    assert extra_arg_env("--no-python") == ("PET_NO_PYTHON", "1")
    assert extra_arg_env("--redirects=3") == ("PET_REDIRECTS", "3")
    env = _env(make_job(torchrun={"extraArgs": ["--monitor-interval=1"]}))
    assert env["PET_MONITOR_INTERVAL"] == "1"


def test_merge_env_contract_wins_user_may_tune():
    op = [{"name": "PET_NNODES", "value": "2:2"}, {"name": "OMP_NUM_THREADS", "value": "1"}]
    user = [{"name": "PET_NNODES", "value": "9"}, {"name": "OMP_NUM_THREADS", "value": "4"},
            {"name": "X", "value": "y"}]
    merged = merge_env(op, user)
    assert merged == [{"name": "PET_NNODES", "value": "2:2"}, {"name": "OMP_NUM_THREADS", "value": "4"},
                      {"name": "X", "value": "y"}]
    assert len({e["name"] for e in merged}) == len(merged)
