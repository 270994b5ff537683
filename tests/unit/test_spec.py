"""spec.parse_job: defaults in one place, and every validation message names its field."""

import pytest

from ddp_operator import crd
from ddp_operator.spec import SpecError, parse_job, parse_spec

from ddp_builders import job_body, make_job


def test_defaults_match_the_crd():
    s = make_job().spec
    assert (s.nodes, s.min_nodes, s.max_nodes, s.nproc_per_node, s.omp_num_threads) == (2, 2, 2, 1, 1)
    t = crd.DEFAULTS["torchrun"]
    assert s.torchrun.rdzv_port == t["rdzvPort"] == 29400
    assert s.torchrun.keep_alive_interval_seconds == t["keepAliveIntervalSeconds"]
    assert s.failure_policy.backoff_limit == crd.DEFAULTS["failurePolicy"]["backoffLimit"]
    assert s.failure_policy.count_disruptions is False
    assert s.run_policy.clean_pod_policy == "Running"
    assert s.shm.medium == "Memory"
    assert s.checkpoint is None
    assert s.progress_period_seconds == 30


def test_spec_is_frozen():
    s = make_job().spec
    with pytest.raises(AttributeError):
        s.nodes = 3


def test_auto_nproc_counts_gpus():
    body = job_body(nprocPerNode="auto")
    body["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": 4}}
    assert parse_job(body).spec.nproc_per_node == 4
    assert make_job(nprocPerNode="auto").spec.nproc_per_node == 1


def test_omp_threads_from_cpu_limit():
    body = job_body(nprocPerNode=2)
    body["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "4"}}
    assert parse_job(body).spec.omp_num_threads == 2
    body["spec"]["template"]["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "500m"}}
    assert parse_job(body).spec.omp_num_threads == 1
    assert make_job(ompNumThreads=3).spec.omp_num_threads == 3


def test_exit_code_policies():
    fp = make_job(failurePolicy={"permanentExitCodes": [3]}).spec.failure_policy
    assert fp.is_permanent((1, 3)) and not fp.is_permanent((1,))
    fp = make_job(failurePolicy={"retryableExitCodes": [1, 137]}).spec.failure_policy
    assert fp.is_permanent((2,)) and not fp.is_permanent((137,)) and not fp.is_permanent(())


def _template(**pod):
    return {"spec": {"containers": [{"name": "trainer", "image": "x"}], **pod}}


INVALID = [
    ({"nodes": 0}, "spec.nodes", "must be >= 1"),
    ({"nodes": "two"}, "spec.nodes", "must be an integer"),
    ({"nodes": None}, "spec.nodes", "is required"),
    ({"nodes": 1001}, "spec.nodes", "must be <= 1000"),
    ({"minNodes": 3}, "spec.minNodes", "must be <= spec.maxNodes"),
    ({"minNodes": 3, "maxNodes": 4}, "spec.nodes", "within [minNodes, maxNodes]"),
    ({"maxNodes": 1}, "spec.minNodes", "must be <= spec.maxNodes"),
    ({"nprocPerNode": 0}, "spec.nprocPerNode", 'integer >= 1 or "auto"'),
    ({"nprocPerNode": "many"}, "spec.nprocPerNode", 'integer >= 1 or "auto"'),
    ({"ompNumThreads": 0}, "spec.ompNumThreads", "must be >= 1"),
    ({"template": None}, "spec.template.spec", "is required"),
    ({"template": {"spec": {"containers": []}}}, "spec.template.spec.containers", "at least the 'trainer'"),
    ({"template": {"spec": {"containers": [{"name": "main", "image": "x"}]}}},
     "spec.template.spec.containers", "named 'trainer'"),
    ({"template": {"spec": {"containers": [{"name": "trainer"}, {"name": "trainer"}]}}},
     "spec.template.spec.containers", "unique"),
    ({"template": _template(restartPolicy="Always")}, "spec.template.spec.restartPolicy", "OnFailure, Never"),
    ({"template": _template(hostname="x")}, "spec.template.spec.hostname", "set by the operator"),
    ({"template": _template(subdomain="x")}, "spec.template.spec.subdomain", "set by the operator"),
    ({"torchrun": {"rdzvPort": 70000}}, "spec.torchrun.rdzvPort", "<= 65535"),
    ({"torchrun": {"rdzvPort": 29401}}, "spec.torchrun.rdzvPort", "progress port"),
    ({"torchrun": {"joinTimeoutSeconds": 0}}, "spec.torchrun.joinTimeoutSeconds", ">= 1"),
    ({"torchrun": {"keepAliveIntervalSeconds": 0}}, "spec.torchrun.keepAliveIntervalSeconds", ">= 1"),
    ({"torchrun": {"maxRestarts": -1}}, "spec.torchrun.maxRestarts", ">= 0"),
    ({"torchrun": {"extraArgs": ["log-dir=/x"]}}, "spec.torchrun.extraArgs", "--option=value"),
    ({"torchrun": {"extraArgs": ["--nnodes=4"]}}, "spec.torchrun.extraArgs", "operator owns"),
    ({"torchrun": {"extraArgs": "--x"}}, "spec.torchrun.extraArgs", "must be a list"),
    ({"torchrun": "fast"}, "spec.torchrun", "must be an object"),
    ({"failurePolicy": {"backoffLimit": -1}}, "spec.failurePolicy.backoffLimit", ">= 0"),
    ({"failurePolicy": {"permanentExitCodes": [0]}}, "spec.failurePolicy.permanentExitCodes", "between 1 and 255"),
    ({"failurePolicy": {"permanentExitCodes": [3], "retryableExitCodes": [1]}}, "spec.failurePolicy", "not both"),
    ({"failurePolicy": {"countDisruptions": "yes"}}, "spec.failurePolicy.countDisruptions", "true or false"),
    ({"failurePolicy": {"stuckTerminatingTimeoutSeconds": 0}}, "spec.failurePolicy.stuckTerminatingTimeoutSeconds", ">= 1"),
    ({"runPolicy": {"suspend": "no"}}, "spec.runPolicy.suspend", "true or false"),
    ({"runPolicy": {"activeDeadlineSeconds": 0}}, "spec.runPolicy.activeDeadlineSeconds", ">= 1"),
    ({"runPolicy": {"ttlSecondsAfterFinished": -5}}, "spec.runPolicy.ttlSecondsAfterFinished", ">= 0"),
    ({"runPolicy": {"cleanPodPolicy": "Some"}}, "spec.runPolicy.cleanPodPolicy", "None, Running, All"),
    ({"shm": {"medium": "HugePages"}}, "spec.shm.medium", '"Memory" or ""'),
    ({"checkpoint": {"mountPath": "/ckpt"}}, "spec.checkpoint.volume", "is required"),
    ({"checkpoint": {"volume": {"emptyDir": {}}, "mountPath": "ckpt"}}, "spec.checkpoint.mountPath", "absolute path"),
    ({"progressPeriodSeconds": -1}, "spec.progressPeriodSeconds", ">= 0"),
]


@pytest.mark.parametrize("spec,field,message", INVALID, ids=[f"{i}-{f}" for i, (_, f, _) in enumerate(INVALID)])
def test_invalid_spec_names_the_field(spec, field, message):
    body = job_body(**spec)
    if spec.get("nodes", 1) is None:
        del body["spec"]["nodes"]
    with pytest.raises(SpecError) as err:
        parse_job(body)
    assert err.value.field == field
    assert message in str(err.value)
    assert str(err.value).startswith(field + ":")


@pytest.mark.parametrize("name,message", [
    ("a" * 59, "at most 58 characters"),
    ("9lives", "DNS-1035"),
    ("My-Job", "DNS-1035"),
    ("job.v1", "DNS-1035"),
])
def test_invalid_names(name, message):
    with pytest.raises(SpecError) as err:
        parse_job(job_body(name=name))
    assert err.value.field == "metadata.name"
    assert message in err.value.message


def test_spec_must_be_an_object():
    with pytest.raises(SpecError, match="^spec: must be an object"):
        parse_spec(["nodes"])


@pytest.mark.parametrize("field", ["activeDeadlineSeconds", "ttlSecondsAfterFinished"])
def test_durations_have_a_maximum_that_datetime_arithmetic_survives(field):
    from datetime import datetime, timedelta, timezone
    with pytest.raises(SpecError, match=f"spec.runPolicy.{field}: must be <= {crd.MAX_DURATION_SECONDS}"):
        parse_job(job_body(runPolicy={field: 10 ** 12}))
    top = parse_job(job_body(runPolicy={field: crd.MAX_DURATION_SECONDS})).spec.run_policy
    assert datetime(9000, 1, 1, tzinfo=timezone.utc) + timedelta(seconds=crd.MAX_DURATION_SECONDS)
    assert top.active_deadline_seconds or top.ttl_seconds_after_finished


def test_every_seconds_field_is_capped_like_the_crd():
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]

    def walk(props, path):
        for key, sub in props.items():
            if "properties" in sub:
                yield from walk(sub["properties"], f"{path}.{key}")
            elif "Seconds" in key:
                yield f"{path}.{key}", sub

    fields = list(walk(schema, "spec"))
    assert len(fields) >= 7
    for path, sub in fields:
        assert "maximum" in sub, path
        parts = path.split(".")[1:]
        body = job_body()
        target = body["spec"]
        for p in parts[:-1]:
            target = target.setdefault(p, {})
        target[parts[-1]] = sub["maximum"] + 1
        with pytest.raises(SpecError, match=f"{path}: must be <= {sub['maximum']}"):
            parse_job(body)
