"""The diagnostics sidecar on the trainer pods (docs/diagnostics.md): what spec.diagnostics adds to a pod, as whom the
sidecar runs, what it may do, and what a template may no longer take. The whole pod is in the golden files
(test_render.py); these state the rules one by one."""

import dataclasses

import pytest

from ddp_operator import names
from ddp_operator.pod import render_trainer_pod
from ddp_operator.rdzv import render_rdzv_pod
from ddp_operator.spec import SpecError, parse_job

from ddp_builders import IMAGE, job_body, make_job


def _containers(pod):
    """Every container of the pod by name, the init containers (ours: the tools and the native sidecar) too."""
    return {c["name"]: c for c in pod["spec"]["containers"] + (pod["spec"].get("initContainers") or [])}


def _init(pod):
    return {c["name"]: c for c in pod["spec"].get("initContainers") or []}


def _effective(pod, container, key):
    """A securityContext key as the kubelet applies it: the container's, else the pod's."""
    own = container.get("securityContext") or {}
    return own[key] if key in own else (pod["spec"].get("securityContext") or {}).get(key)


def test_every_trainer_pod_gets_the_sidecar_its_tools_and_a_shared_process_namespace():
    pod = render_trainer_pod(make_job(), 1, 0)
    spec = pod["spec"]
    assert spec["shareProcessNamespace"] is True
    sidecar = _containers(pod)[names.DIAGNOSTICS_CONTAINER]
    trainer = _containers(pod)[names.TRAINER_CONTAINER]
    # the trainer image's python3 runs the server the init container copied
    assert sidecar["image"] == trainer["image"] == IMAGE
    # a native sidecar: it runs beside the trainer and ends with it, so a finished pod can succeed
    assert sidecar["restartPolicy"] == "Always" and \
        [c["name"] for c in spec["initContainers"]] == [names.DIAGNOSTICS_TOOLS_CONTAINER, names.DIAGNOSTICS_CONTAINER]
    assert [c["name"] for c in spec["containers"]] == [names.TRAINER_CONTAINER]
    assert sidecar["command"] == ["python3", "/opt/ddp-diagnostics/diagnose.py", "--port", "29402",
                                  "--py-spy", "/opt/ddp-diagnostics/py-spy"]
    assert sidecar["ports"] == [{"name": "diagnostics", "containerPort": 29402, "protocol": "TCP"}]
    assert sidecar["resources"] == {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "256Mi"}}
    assert sidecar["securityContext"]["allowPrivilegeEscalation"] is False
    # a CUDA image's NVIDIA_VISIBLE_DEVICES=all would hand the sidecar every GPU of the node
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in sidecar["env"]
    assert {"name": "ddp-diagnostics", "mountPath": "/opt/ddp-diagnostics", "readOnly": True} in sidecar["volumeMounts"]
    tools = _init(pod)[names.DIAGNOSTICS_TOOLS_CONTAINER]
    assert tools["image"] == "localhost/ddp-operator:0.1.0"  # the operator's own image, when it is told none
    assert tools["command"] == ["cp", "/opt/venv/bin/py-spy", "/opt/ddp/ddp_operator/sidecar/diagnose.py",
                                "/opt/ddp-diagnostics/"]
    assert {"name": "ddp-diagnostics", "mountPath": "/opt/ddp-diagnostics"} in tools["volumeMounts"]
    hardened = tools["securityContext"]
    assert hardened["runAsNonRoot"] is True and hardened["allowPrivilegeEscalation"] is False
    assert hardened["capabilities"] == {"drop": ["ALL"]} and hardened["readOnlyRootFilesystem"] is True
    assert hardened["seccompProfile"] == {"type": "RuntimeDefault"}
    assert tools["resources"]["limits"]["memory"] and tools["resources"]["requests"]["cpu"] == "10m"
    assert {"name": "ddp-diagnostics", "emptyDir": {"sizeLimit": "64Mi"}} in spec["volumes"]
    # `kubectl logs <pod>` still shows the training
    assert pod["metadata"]["annotations"]["kubectl.kubernetes.io/default-container"] == "trainer"


def test_the_tools_image_is_the_operators_setting():
    job = make_job()
    tools = dataclasses.replace(job.spec.diagnostics.tools, image="registry.example/ddp-operator:1.2",
                                pull_policy="Always")
    job = dataclasses.replace(job, spec=dataclasses.replace(
        job.spec, diagnostics=dataclasses.replace(job.spec.diagnostics, tools=tools)))
    c = _init(render_trainer_pod(job, 0, 0))[names.DIAGNOSTICS_TOOLS_CONTAINER]
    assert c["image"] == "registry.example/ddp-operator:1.2" and c["imagePullPolicy"] == "Always"


def _hardened_body(**diagnostics):
    body = job_body(diagnostics=diagnostics) if diagnostics else job_body()
    trainer = body["spec"]["template"]["spec"]["containers"][0]
    trainer["imagePullPolicy"] = "Never"
    trainer["securityContext"] = {"runAsUser": 2000, "runAsGroup": 3000, "runAsNonRoot": True,
                                  "allowPrivilegeEscalation": False, "privileged": False,
                                  "seccompProfile": {"type": "RuntimeDefault"},
                                  "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}
    return body


def test_the_sidecar_runs_as_the_trainers_user_with_its_capabilities():
    pod = render_trainer_pod(parse_job(_hardened_body()), 0, 0)
    sidecar = _containers(pod)[names.DIAGNOSTICS_CONTAINER]
    assert sidecar["imagePullPolicy"] == "Never"
    assert sidecar["securityContext"] == {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
        "readOnlyRootFilesystem": True, "runAsGroup": 3000, "runAsNonRoot": True, "runAsUser": 2000,
        "seccompProfile": {"type": "RuntimeDefault"}}


def test_a_pod_level_user_applies_to_the_sidecar_as_to_the_trainer():
    body = job_body()
    body["spec"]["template"]["spec"]["securityContext"] = {"runAsUser": 2000, "runAsGroup": 2000}
    pod = render_trainer_pod(parse_job(body), 0, 0)
    trainer, sidecar = _containers(pod)[names.TRAINER_CONTAINER], _containers(pod)[names.DIAGNOSTICS_CONTAINER]
    for key in ("runAsUser", "runAsGroup"):
        assert _effective(pod, sidecar, key) == _effective(pod, trainer, key) == 2000


def test_ptrace_adds_sys_ptrace_and_nothing_else():
    plain = _containers(render_trainer_pod(parse_job(_hardened_body()), 0, 0))[names.DIAGNOSTICS_CONTAINER]
    ptrace = _containers(render_trainer_pod(parse_job(_hardened_body(ptrace=True)), 0, 0))[names.DIAGNOSTICS_CONTAINER]
    assert ptrace["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK", "SYS_PTRACE"]}
    del ptrace["securityContext"]["capabilities"], plain["securityContext"]["capabilities"]
    assert ptrace == plain
    # without a trainer securityContext: only SYS_PTRACE, on top of the runtime's default set
    sidecar = _containers(render_trainer_pod(make_job(diagnostics={"ptrace": True}), 0, 0))[names.DIAGNOSTICS_CONTAINER]
    assert sidecar["securityContext"]["capabilities"] == {"add": ["SYS_PTRACE"]}


def test_the_store_pod_has_no_sidecar():
    spec = render_rdzv_pod(make_job(), 0)["spec"]
    assert [c["name"] for c in spec["containers"]] == [names.RDZV_CONTAINER]
    assert "shareProcessNamespace" not in spec and "initContainers" not in spec
    assert not any(v["name"] == names.DIAGNOSTICS_VOLUME for v in spec.get("volumes") or [])


def test_disabled_renders_the_pod_as_before():
    pod = render_trainer_pod(make_job(diagnostics={"enabled": False, "ptrace": True}), 0, 0)
    assert [c["name"] for c in pod["spec"]["containers"]] == [names.TRAINER_CONTAINER]
    assert "shareProcessNamespace" not in pod["spec"] and "initContainers" not in pod["spec"]
    assert [v["name"] for v in pod["spec"]["volumes"]] == [names.SHM_VOLUME]
    assert names.DEFAULT_CONTAINER_ANNOTATION not in pod["metadata"].get("annotations", {})


def test_the_templates_own_init_containers_and_sidecars_keep_their_places():
    body = job_body()
    spec = body["spec"]["template"]["spec"]
    spec["containers"].append({"name": "log-shipper", "image": "busybox"})
    spec["initContainers"] = [{"name": "fetch", "image": "busybox"},
                              {"name": "proxy", "image": "busybox", "restartPolicy": "Always"}]
    body["spec"]["template"]["metadata"] = {"annotations": {names.DEFAULT_CONTAINER_ANNOTATION: "log-shipper"}}
    pod = render_trainer_pod(parse_job(body), 0, 0)
    assert [c["name"] for c in pod["spec"]["initContainers"]] == \
        [names.DIAGNOSTICS_TOOLS_CONTAINER, names.DIAGNOSTICS_CONTAINER, "fetch", "proxy"]
    assert [c["name"] for c in pod["spec"]["containers"]] == ["trainer", "log-shipper"]
    # a template that names its own default container keeps it
    assert pod["metadata"]["annotations"][names.DEFAULT_CONTAINER_ANNOTATION] == "log-shipper"


@pytest.mark.parametrize("where, field", [
    ("containers", "spec.template.spec.containers"),
    ("initContainers", "spec.template.spec.initContainers"),
])
@pytest.mark.parametrize("name", [names.DIAGNOSTICS_CONTAINER, names.DIAGNOSTICS_TOOLS_CONTAINER])
def test_a_template_container_named_like_ours_is_invalid(where, field, name):
    body = job_body()
    body["spec"]["template"]["spec"].setdefault(where, []).append({"name": name, "image": "busybox"})
    with pytest.raises(SpecError) as err:
        parse_job(body)
    assert err.value.field == field and name in err.value.message and "spec.diagnostics.enabled" in err.value.message
    body["spec"]["diagnostics"] = {"enabled": False}
    parse_job(body)  # without the sidecar the name is the template's to use


@pytest.mark.parametrize("change, field", [
    (lambda s: s.update(volumes=[{"name": names.DIAGNOSTICS_VOLUME, "emptyDir": {}}]), "spec.template.spec.volumes"),
    (lambda s: s.update(shareProcessNamespace=False), "spec.template.spec.shareProcessNamespace"),
    (lambda s: s.update(hostPID=True), "spec.template.spec.hostPID"),
    (lambda s: s["containers"][0].update(ports=[{"containerPort": names.DIAGNOSTICS_PORT}]),
     "spec.template.spec.containers[trainer].ports"),
], ids=["volume", "shareProcessNamespace", "hostPID", "port"])
def test_a_template_that_takes_what_the_sidecar_needs_is_invalid_unless_it_is_off(change, field):
    body = job_body()
    change(body["spec"]["template"]["spec"])
    with pytest.raises(SpecError) as err:
        parse_job(body)
    assert err.value.field == field
    body["spec"]["diagnostics"] = {"enabled": False}
    parse_job(body)


def test_the_operator_reads_its_tools_image_from_the_environment(monkeypatch):
    from ddp_operator.__main__ import diagnostics_tools, parse_args
    from ddp_operator.diagnostics import DEFAULT_TOOLS_IMAGE, Tools

    monkeypatch.delenv(names.ENV_DIAGNOSTICS_IMAGE, raising=False)
    monkeypatch.delenv(names.ENV_DIAGNOSTICS_IMAGE_PULL_POLICY, raising=False)
    assert diagnostics_tools(parse_args([])) == Tools(DEFAULT_TOOLS_IMAGE, None)
    monkeypatch.setenv(names.ENV_DIAGNOSTICS_IMAGE, "registry.example/ddp-operator:1.2")
    monkeypatch.setenv(names.ENV_DIAGNOSTICS_IMAGE_PULL_POLICY, "Always")
    assert diagnostics_tools(parse_args([])) == Tools("registry.example/ddp-operator:1.2", "Always")
    with pytest.raises(SystemExit):
        parse_args(["--diagnostics-image-pull-policy=Sometimes"])


def test_the_pods_a_pass_creates_carry_the_operators_tools_image():
    from ddp_operator.diagnostics import Tools
    from ddp_operator.reconciler import Config, Reconciler

    from fake_api import FakeApi

    body = job_body()
    index = {"ddpjobs_by_key": {("ml", "mnist"): [body]}, "pods_by_job": {}, "services_by_job": {}}
    r = Reconciler(FakeApi(index), Config(diagnostics=Tools("registry.example/ddp-operator:1.2", "IfNotPresent")))
    r.indexes = index
    r.reconcile("ml", "mnist")
    trainers = [p for p in index["pods_by_job"][("ml", "mnist")]
                if p["metadata"]["labels"][names.LABEL_ROLE] == names.ROLE_TRAINER]
    assert len(trainers) == 2
    for pod in trainers:
        tools = _init(pod)[names.DIAGNOSTICS_TOOLS_CONTAINER]
        assert (tools["image"], tools["imagePullPolicy"]) == ("registry.example/ddp-operator:1.2", "IfNotPresent")


def test_a_template_fit_for_pod_security_restricted_stays_fit_with_the_sidecar():
    """On by default, the sidecar must not push a hardened job out of a `restricted` namespace: every container of
    the pod (init containers too) passes the level's container checks."""
    body = job_body()
    spec = body["spec"]["template"]["spec"]
    spec["securityContext"] = {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}}
    spec["containers"][0]["securityContext"] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    pod = render_trainer_pod(parse_job(body), 0, 0)
    containers = pod["spec"]["containers"] + pod["spec"]["initContainers"]
    assert {c["name"] for c in containers} >= {names.DIAGNOSTICS_CONTAINER, names.DIAGNOSTICS_TOOLS_CONTAINER}
    for c in containers:
        sc = c.get("securityContext") or {}
        assert sc.get("allowPrivilegeEscalation") is False, c["name"]
        assert sc.get("capabilities", {}).get("drop") == ["ALL"] and not sc["capabilities"].get("add"), c["name"]
        assert _effective(pod, c, "runAsNonRoot") is True, c["name"]
        assert _effective(pod, c, "seccompProfile")["type"] in ("RuntimeDefault", "Localhost"), c["name"]
        assert _effective(pod, c, "runAsUser") != 0, c["name"]


def test_a_trainer_with_cap_sys_admin_gets_a_sidecar_the_api_server_accepts():
    """The API server refuses allowPrivilegeEscalation: false beside capabilities.add CAP_SYS_ADMIN: the sidecar, which
    keeps the trainer's capabilities, takes the trainer's own setting then."""
    body = job_body()
    body["spec"]["template"]["spec"]["containers"][0]["securityContext"] = {"capabilities": {"add": ["CAP_SYS_ADMIN"]}}
    sidecar = _containers(render_trainer_pod(parse_job(body), 0, 0))[names.DIAGNOSTICS_CONTAINER]
    assert sidecar["securityContext"]["capabilities"] == {"add": ["CAP_SYS_ADMIN"]}
    assert "allowPrivilegeEscalation" not in sidecar["securityContext"]
