"""spec.diagnostics and failurePolicy.processGroupTimeoutSeconds (docs/diagnostics.md): defaults, bounds and types,
the same in the parser and in the CRD the API server applies."""

import pytest

from ddp_operator import crd, names
from ddp_operator.spec import SpecError, parse_job

from ddp_builders import job_body, make_job


def _spec_schema():
    return crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_defaults():
    job = make_job()
    assert job.spec.diagnostics.enabled is True and job.spec.diagnostics.ptrace is False
    assert job.spec.failure_policy.process_group_timeout_seconds == 300


def test_values_as_written():
    job = make_job(diagnostics={"enabled": False, "ptrace": True},
                   failurePolicy={"processGroupTimeoutSeconds": 0})
    assert job.spec.diagnostics.enabled is False and job.spec.diagnostics.ptrace is True
    assert job.spec.failure_policy.process_group_timeout_seconds == 0  # 0: never
    assert make_job(failurePolicy={"processGroupTimeoutSeconds": 86400}).spec.failure_policy \
        .process_group_timeout_seconds == 86400


@pytest.mark.parametrize("spec, field", [
    ({"failurePolicy": {"processGroupTimeoutSeconds": -1}}, "spec.failurePolicy.processGroupTimeoutSeconds"),
    ({"failurePolicy": {"processGroupTimeoutSeconds": 86401}}, "spec.failurePolicy.processGroupTimeoutSeconds"),
    ({"failurePolicy": {"processGroupTimeoutSeconds": "300"}}, "spec.failurePolicy.processGroupTimeoutSeconds"),
    ({"failurePolicy": {"processGroupTimeoutSeconds": True}}, "spec.failurePolicy.processGroupTimeoutSeconds"),
    ({"diagnostics": "on"}, "spec.diagnostics"),
    ({"diagnostics": {"enabled": "yes"}}, "spec.diagnostics.enabled"),
    ({"diagnostics": {"ptrace": 1}}, "spec.diagnostics.ptrace"),
])
def test_wrong_values_name_their_field(spec, field):
    with pytest.raises(SpecError) as err:
        parse_job(job_body(**spec))
    assert err.value.field == field


def test_the_crd_defaults_bounds_and_immutability_are_the_parsers():
    spec = _spec_schema()
    timeout = spec["properties"]["failurePolicy"]["properties"]["processGroupTimeoutSeconds"]
    assert (timeout["default"], timeout["minimum"], timeout["maximum"]) == (300, 0, 86400)
    assert "0: never" in timeout["description"] and "restart" in timeout["description"]
    diagnostics = spec["properties"]["diagnostics"]
    assert diagnostics["default"] == {}
    assert {k: v["default"] for k, v in diagnostics["properties"].items()} == {"enabled": True, "ptrace": False}
    # what it costs, and the permission the ptrace option needs, are said where users read (kubectl explain)
    assert "10m CPU" in diagnostics["description"] and "32Mi" in diagnostics["description"]
    assert "privileged" in diagnostics["properties"]["ptrace"]["description"]
    assert any(r["message"].startswith("spec.diagnostics is immutable") for r in spec["x-kubernetes-validations"])


def test_the_status_schema_holds_a_diagnosis():
    status = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    diagnosis = status["properties"]["diagnosis"]
    # every key the planner writes (plan/stall.py): the API server would prune any other, and the signature is what
    # tells a second identical diagnosis after a restart (read back from the status after an operator restart)
    assert set(diagnosis["properties"]) == {"time", "reason", "message", "ranks", "signature", "incarnation"}
    ranks = diagnosis["properties"]["ranks"]
    assert ranks["maxItems"] == 64
    rank = ranks["items"]["properties"]
    assert set(rank) == {"rank", "pod", "phase", "frame", "userFrame"}
    assert rank["rank"]["type"] == "integer"
    assert all(rank[k]["maxLength"] == 512 for k in ("pod", "phase", "frame", "userFrame"))
    # without stacks the frames are null: the API server must take them
    assert rank["frame"]["nullable"] and rank["userFrame"]["nullable"]
    assert names.COND_STALLED in status["properties"]["conditions"]["description"]
