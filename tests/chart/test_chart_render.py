"""The Helm chart without a cluster: lint, what the templates render, and what the values schema rejects."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests import rbac_needs
from tests.chart.conftest import (CHART, KUBE_VERSION, VALUES_ALL, by_kind, one, operator_cluster_roles, operator_role,
                                  run, user_roles)

OPERATOR_VERBS_FORBIDDEN = {"*", "escalate", "bind", "impersonate"}


@pytest.mark.parametrize("values", [None, VALUES_ALL], ids=["defaults", "all-options"])
def test_helm_lint_strict(helm_bin, values):
    cmd = [helm_bin, "lint", "--strict", str(CHART)]
    if values:
        cmd += ["--values", str(values)]
    out = run(cmd).stdout
    assert "1 chart(s) linted, 0 chart(s) failed" in out


def test_chart_metadata():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == "0.1.0" and chart["appVersion"] == "0.1.0"
    assert chart["kubeVersion"].startswith(">=1.28")


# Blocks described as a whole (their content is a Kubernetes type, documented upstream).
WHOLE_BLOCKS = {"resources", "podSecurityContext", "securityContext"}


def test_every_value_is_commented():
    """Each value in values.yaml has a comment right above it: values.yaml is the chart's manual."""
    undocumented, stack, previous = [], [], ""
    for line in (CHART / "values.yaml").read_text().splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#") or stripped.startswith("-"):
            previous = stripped
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key, _, value = stripped.partition(":")
        in_whole_block = any(k in WHOLE_BLOCKS for _, k in stack)
        is_section = value.strip() == ""
        if not (previous.startswith("#") or is_section or in_whole_block):
            undocumented.append(".".join([k for _, k in stack] + [key]))
        stack.append((indent, key))
        previous = stripped
    assert not undocumented, f"values.yaml keys without a comment: {undocumented}"


def test_defaults_render_hardened_operator(render):
    objs = render()
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == ["ClusterRole", "ClusterRole", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                     "Deployment", "Service",
                     "ServiceAccount",
                     "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    dep = one(objs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "localhost/ddp-operator:0.1.0"
    assert c["imagePullPolicy"] == "IfNotPresent"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["enableServiceLinks"] is False  # DDP_OPERATOR_METRICS_PORT would clash with the operator's own
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert c["livenessProbe"]["httpGet"]["port"] == "health"
    # Ready only in the replica that acts (probes.py): the metrics Service reaches the leader alone.
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "readiness"}
    assert {"name": "readiness", "containerPort": 8082, "protocol": "TCP"} in c["ports"]
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    assert c["args"] == ["--log-format=json", "--liveness-port=8081", "--readiness-port=8082", "--metrics-port=8080"]
    assert dep["spec"]["strategy"]["type"] == "Recreate"
    svc = one(objs, "Service")
    assert svc["spec"]["ports"][0]["targetPort"] == "metrics"
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]


def test_cluster_rbac_is_least_privilege(render):
    role = operator_role(render())
    granted = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                granted.setdefault((group, res), set()).update(rule["verbs"])
                assert not OPERATOR_VERBS_FORBIDDEN & set(rule["verbs"]), rule
                assert res != "*" and group != "*", rule
    needs = rbac_needs.needs()
    assert rbac_needs.granted(role["rules"]) == needs.namespaced | needs.cluster
    assert not any(res in {"secrets", "pods/exec", "leases"} for _, res in granted)
    # ConfigMaps: only each job's metric history (<job>-history), read and replaced by name; never listed or watched
    assert granted.get(("", "configmaps"), {"get", "create", "update"}) == {"get", "create", "update"}
    assert not any("update" in verbs for (g, res), verbs in granted.items()
                   if res not in ("ddpjobs/finalizers", "configmaps"))


def test_every_scope_grants_exactly_what_the_code_needs(render):
    """Derived from the operator's calls (tests/rbac_needs.py): the namespaced Roles get the namespaced needs,
    the leader-election Role the Lease needs, the ClusterRole both namespaced and cluster-only ones."""
    needs = rbac_needs.needs()
    objs = render("--set", "rbac.scope=namespace", "--set", "watch.namespaces={team-a}", "--set", "replicaCount=2")
    roles = {r["metadata"]["name"]: r for r in by_kind(objs, "Role")}
    leader = roles.pop("ddp-operator-leader-election")
    (namespaced,) = roles.values()
    assert rbac_needs.granted(namespaced["rules"]) == needs.namespaced
    assert rbac_needs.granted(leader["rules"]) == needs.leader
    cluster = render("--set", "replicaCount=2")
    assert rbac_needs.granted(operator_role(cluster)["rules"]) == needs.namespaced | needs.cluster
    assert rbac_needs.granted(one(cluster, "Role")["rules"]) == needs.leader
def test_network_policy_settings_reach_the_operator(render):
    def env(*args):
        c = one(render(*args), "Deployment")["spec"]["template"]["spec"]["containers"][0]
        return {e["name"]: e.get("value") for e in c["env"]}
    default = env()
    # The jobs' policies admit the operator's own pods: exactly the Deployment's selector labels.
    assert default["DDP_OPERATOR_POD_LABELS"] == "app.kubernetes.io/name=ddp-operator,app.kubernetes.io/instance=ddp-operator"
    assert default["DDP_OPERATOR_NETWORK_POLICY"] == "true"
    assert env("--set", "networkPolicy.enabled=false")["DDP_OPERATOR_NETWORK_POLICY"] == "false"


def test_the_diagnostics_image_is_the_operators_own_unless_set(render, helm_bin):
    """The training pods' diagnostics sidecar copies its tools from this image (docs/diagnostics.md): by default the
    operator's image, whatever image.* says; diagnostics.image.* overrides each part."""
    def env(*args):
        c = one(render(*args), "Deployment")["spec"]["template"]["spec"]["containers"][0]
        e = {e["name"]: e.get("value") for e in c["env"]}
        return e["DDPJOB_DIAGNOSTICS_IMAGE"], e["DDPJOB_DIAGNOSTICS_IMAGE_PULL_POLICY"]
    assert env() == ("localhost/ddp-operator:0.1.0", "IfNotPresent")
    assert env("--set", "image.repository=registry.example/ddp", "--set", "image.tag=1.2",
               "--set", "image.pullPolicy=Always") == ("registry.example/ddp:1.2", "Always")
    assert env("--set", "diagnostics.image.repository=registry.example/tools", "--set", "diagnostics.image.tag=2.0",
               "--set", "diagnostics.image.pullPolicy=Never") == ("registry.example/tools:2.0", "Never")
    assert env("--set", "diagnostics.image.tag=0.2.0") == ("localhost/ddp-operator:0.2.0", "IfNotPresent")
    proc = run([helm_bin, "template", "x", str(CHART), "--kube-version", KUBE_VERSION,
                "--set", "diagnostics.image.tag=latest"], check=False)
    assert proc.returncode != 0 and "diagnostics.image.tag=latest" in proc.stderr


DIGEST = "sha256:" + "ab" * 32


def test_a_digest_pins_the_operator_and_its_diagnostics_image(render):
    """image.digest (what a released chart sets): repository:tag@digest, for the diagnostics tools too unless
    diagnostics.image names another image."""
    def images(*args: str) -> tuple[str, str]:
        c = one(render(*args), "Deployment")["spec"]["template"]["spec"]["containers"][0]
        return c["image"], next(e["value"] for e in c["env"] if e["name"] == "DDPJOB_DIAGNOSTICS_IMAGE")
    pinned = f"localhost/ddp-operator:0.1.0@{DIGEST}"
    assert images("--set", f"image.digest={DIGEST}") == (pinned, pinned)
    assert images("--set", f"image.digest={DIGEST}", "--set", "diagnostics.image.tag=0.2.0") == (
        pinned, "localhost/ddp-operator:0.2.0")
    assert images("--set", f"diagnostics.image.digest={DIGEST}") == ("localhost/ddp-operator:0.1.0", pinned)


def test_the_store_image_is_store_image_pinned_by_its_digest(render, helm_bin):
    """The jobs' rendezvous-store pods run storeImage (the operator's DDP_OPERATOR_STORE_IMAGE), whatever image.*
    says; its digest pins it; `latest` is refused."""
    def store(*args: str) -> str:
        c = one(render(*args), "Deployment")["spec"]["template"]["spec"]["containers"][0]
        return next(e["value"] for e in c["env"] if e["name"] == "DDP_OPERATOR_STORE_IMAGE")
    assert store() == "localhost/ddp-store:0.1.0"
    assert store("--set", "image.repository=registry.example/ddp", "--set", f"image.digest={DIGEST}") == (
        "localhost/ddp-store:0.1.0")
    assert store("--set", "storeImage.repository=registry.example/store", "--set", "storeImage.tag=1.2",
                 "--set", f"storeImage.digest={DIGEST}") == f"registry.example/store:1.2@{DIGEST}"
    proc = run([helm_bin, "template", "x", str(CHART), "--kube-version", KUBE_VERSION,
                "--set", "storeImage.tag=latest"], check=False)
    assert proc.returncode != 0 and "storeImage.tag=latest" in proc.stderr


def test_namespace_scope_creates_only_namespaced_rbac(render):
    objs = render("--set", "rbac.scope=namespace", "--set", "watch.namespaces={team-a,team-b}")
    # Nothing cluster-wide for the operator; the users' roles (aggregated into edit/view) are apart.
    assert not operator_cluster_roles(objs) and not by_kind(objs, "ClusterRoleBinding")
    roles = by_kind(objs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert not any("nodes" in rule["resources"] for rule in role["rules"])
    bindings = by_kind(objs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    assert all(b["subjects"][0]["namespace"] == "ddp-system" for b in bindings)
    args = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_more_replicas_turn_leader_election_on(render):
    objs = render("--set", "replicaCount=2")
    dep = one(objs, "Deployment")
    # Only the leader is ever Ready: a rollout that waited for a new Ready Pod before stopping the old leader would
    # wait forever (the new standby cannot lead while the old leader holds the Lease).
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate",
                                       "rollingUpdate": {"maxSurge": 1, "maxUnavailable": "100%"}}
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--leader-elect" in args and "--lease-name=ddp-operator" in args
    role = one(objs, "Role")
    assert role["metadata"]["namespace"] == "ddp-system"
    assert {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["ddp-operator"],
            "verbs": ["get", "update"]} in role["rules"]
    assert one(objs, "RoleBinding")["roleRef"]["name"] == role["metadata"]["name"]


def test_all_options_render(render):
    objs = render("--values", str(VALUES_ALL))
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == ["ConfigMap", "CustomResourceDefinition", "Deployment", "PodDisruptionBudget", "Role", "Role",
                     "Role", "RoleBinding",
                     "RoleBinding", "RoleBinding", "Service", "ServiceAccount", "ServiceMonitor",
                     "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    policy, binding = _admission(objs)
    assert '"ci-runner@example.com"' in policy["spec"]["matchConditions"][0]["expression"]
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][0]["values"] == [
        "team-a", "team-b"]
    sm = one(objs, "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True  # a job's namespace label stays the job's
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    dep = one(objs, "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert {"containerPort": 9090, "name": "metrics", "protocol": "TCP"} in c["ports"]
    assert "--metrics-port=9090" in c["args"] and "--liveness-port=9091" in c["args"]
    assert "--readiness-port=9092" in c["args"] and c["readinessProbe"]["httpGet"]["port"] == "readiness"
    assert dep["spec"]["template"]["spec"]["topologySpreadConstraints"][0]["topologyKey"] == \
        "topology.kubernetes.io/zone"  # the user's list replaces the default
    assert "--verbose" in c["args"] and "--leader-elect" in c["args"]
    assert c["args"][-1] == "--lease-namespace=ddp-system"  # extraArgs come last


def test_the_dashboard_ships_for_grafanas_sidecar_only_when_enabled(render):
    """dashboards.enabled: the dashboard JSON, byte for byte, in a ConfigMap with the sidecar's label (its key and
    value configurable), in the release namespace unless dashboards.namespace says otherwise."""
    assert not by_kind(render(), "ConfigMap")
    cm = one(render("--set", "dashboards.enabled=true"), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["namespace"] == "ddp-system"
    assert cm["data"]["ddpjob.json"] == (CHART / "dashboards" / "ddpjob.json").read_text().rstrip("\n")
    board = json.loads(cm["data"]["ddpjob.json"])
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "namespace", "job"}
    cm = one(render("--set", "dashboards.enabled=true", "--set", "dashboards.label=dash",
                    "--set", "dashboards.labelValue=yes", "--set", "dashboards.namespace=monitoring",
                    "--set", "dashboards.annotations.grafana_folder=Training"), "ConfigMap")
    assert cm["metadata"]["labels"]["dash"] == "yes" and "grafana_dashboard" not in cm["metadata"]["labels"]
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Training"}


def test_operator_pods_spread_over_nodes_unless_told_otherwise(render):
    """One constraint by default (maxSkew 1 over nodes, ScheduleAnyway: never Pending for it), counting only the
    Pods of one rollout; another topology key, the user's own list, or none."""
    def spread(*args):
        return one(render(*args), "Deployment")["spec"]["template"]["spec"].get("topologySpreadConstraints")
    dep = one(render(), "Deployment")
    (default,) = spread("--set", "replicaCount=2")
    assert default == {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
                       "labelSelector": {"matchLabels": dep["spec"]["selector"]["matchLabels"]},
                       "matchLabelKeys": ["pod-template-hash"]}
    assert spread() == [default]  # harmless with one replica; its surge Pod in a rollout is spread too
    (zone,) = spread("--set", "topologySpread.topologyKey=topology.kubernetes.io/zone")
    assert zone == {**default, "topologyKey": "topology.kubernetes.io/zone"}
    assert spread("--set", "topologySpread.enabled=false") is None
    own = [{"maxSkew": 2, "topologyKey": "rack", "whenUnsatisfiable": "DoNotSchedule"}]
    assert spread("--set-json", f"topologySpreadConstraints={json.dumps(own)}") == own


def test_disruption_budget_only_when_asked(render):
    """Off by default, with any replicaCount (only the leader is ever Ready: a budget would keep the leader from ever
    being evicted); when enabled, one Pod kept and the never-Ready standbys always evictable."""
    assert not by_kind(render(), "PodDisruptionBudget")
    assert not by_kind(render("--set", "replicaCount=3"), "PodDisruptionBudget")
    objs = render("--set", "replicaCount=2", "--set", "podDisruptionBudget.enabled=true")
    pdb = one(objs, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1" and pdb["metadata"]["namespace"] == "ddp-system"
    assert pdb["spec"] == {"minAvailable": 1, "unhealthyPodEvictionPolicy": "AlwaysAllow",
                           "selector": one(objs, "Deployment")["spec"]["selector"]}


def test_users_roles_aggregate_into_the_builtin_ones(render):
    """<fullname>-edit joins admin and edit (every verb on DDPJobs, their scale; status read-only), <fullname>-view
    joins view (read DDPJobs, status and scale); whatever the operator's RBAC scope; off with the value."""
    for args in ((), ("--set", "rbac.scope=namespace", "--set", "watch.namespaces={team-a}"),
                 ("--set", "rbac.create=false")):
        roles = {r["metadata"]["name"]: r for r in user_roles(render(*args, release="ml"))}
        assert set(roles) == {"ml-ddp-operator-edit", "ml-ddp-operator-view"}, args
    edit, view = roles["ml-ddp-operator-edit"], roles["ml-ddp-operator-view"]
    aggregate = "rbac.authorization.k8s.io/aggregate-to-"
    assert {k for k, v in edit["metadata"]["labels"].items() if k.startswith(aggregate) and v == "true"} == {
        aggregate + "admin", aggregate + "edit"}
    assert {k for k in view["metadata"]["labels"] if k.startswith(aggregate)} == {aggregate + "view"}

    def grants(role):
        return {(res, verb) for rule in role["rules"] for res in rule["resources"] for verb in rule["verbs"]
                if rule["apiGroups"] == ["ddp.dev"]}
    crud = {"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"}
    assert grants(edit) == {("ddpjobs", v) for v in crud} | {("ddpjobs/scale", v) for v in ("get", "update", "patch")} \
        | {("ddpjobs/status", "get")}
    assert grants(view) == {(r, v) for r in ("ddpjobs", "ddpjobs/status", "ddpjobs/scale") for v in ("get", "list", "watch")}
    assert not user_roles(render("--set", "rbac.aggregateToDefaultRoles=false"))


def test_metrics_off_removes_service_and_port(render):
    objs = render("--set", "metrics.enabled=false")
    assert not by_kind(objs, "Service")
    c = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert [p["name"] for p in c["ports"]] == ["health", "readiness"]
    assert "--metrics-port=0" in c["args"]


# --- values schema: bad input fails `helm template/install` with a message naming the value ----------
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--set", "replicaCount=two"], "replicaCount"),
        (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
        (["--set", "diagnostics.image.pullPolicy=Sometimes"], "pullPolicy"),
        (["--set", "diagnostics.image.registry=docker.io"], "registry"),
        (["--set", "rbac.scope=everywhere"], "scope"),
        (["--set", "operator.logFormat=xml"], "logFormat"),
        (["--set", "operator.verbose=loud"], "verbose"),
        (["--set", "metrics.port=70000"], "port"),
        (["--set", "metrics.enabled=yes-please"], "enabled"),
        (["--set", "watch.namespaces=team-a"], "namespaces"),
        (["--set", "watch.exclude={Team-*}"], "exclude"),
        (["--set", "dashboards.enabled=maybe"], "enabled"),
        (["--set", "dashboards.label=bad key"], "label"),
        (["--set", "dashboards.namespace=Monitoring"], "namespace"),
        (["--set", "unknownKey=1"], "unknownKey"),
        (["--set", "image.registry=docker.io"], "registry"),
        (["--set", "image.digest=sha256:abc"], "digest"),
        (["--set", "crds.enabled=yes"], "enabled"),
        (["--set", "securityContext.runAsRoot=true"], "runAsRoot"),
    ],
    ids=lambda v: v if isinstance(v, str) else v[-1],
)
def test_values_schema_rejects(helm_bin, args, expected):
    proc = run([helm_bin, "template", "x", str(CHART), "--kube-version", KUBE_VERSION, *args], check=False)
    assert proc.returncode != 0, f"{args} was accepted"
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert expected in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--set", "rbac.scope=namespace"], "rbac.scope=namespace needs watch.namespaces"),
        (["--set", "replicaCount=2", "--set", "operator.leaderElection.mode=off"],
         "replicaCount > 1 needs leader election"),
        (["--set", "image.tag=latest"], "image.tag=latest is refused"),
        (["--set", "watch.namespaces={team-a}", "--set", "watch.exclude={team-b}"],
         "watch.exclude applies when watching every namespace"),
    ],
    ids=["namespace-scope-without-namespaces", "replicas-without-leader-election", "latest-tag",
         "exclude-with-namespaces"],
)
def test_inconsistent_values_fail_with_the_fix(helm_bin, args, expected):
    proc = run([helm_bin, "template", "x", str(CHART), "--kube-version", KUBE_VERSION, *args], check=False)
    assert proc.returncode != 0
    assert expected in proc.stderr, proc.stderr


def test_schema_forbids_unknown_keys_everywhere():
    def walk(node, path):
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is False, f"{path or '<root>'} allows unknown keys"
            for key, child in node["properties"].items():
                walk(child, f"{path}.{key}".lstrip("."))
    schema = json.loads((CHART / "values.schema.json").read_text())
    walk(schema, "")
    # and every value in values.yaml is described by the schema
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def covered(v, node, path):
        props = node.get("properties")
        if isinstance(v, dict) and props is not None:
            for k, child in v.items():
                assert k in props, f"{path}{k} is not in values.schema.json"
                covered(child, props[k], f"{path}{k}.")
    covered(values, schema, "")


def test_kueue_rbac_only_when_enabled(render):
    """kueue.enabled adds exactly the Kueue needs (tests/rbac_needs.py): Workloads with the other namespaced rules,
    ResourceFlavors and WorkloadPriorityClasses cluster-wide (their own ClusterRole in the namespace scope)."""
    needs = rbac_needs.needs()
    kueue_ns = {r for r in needs.kueue if r[1].startswith("workloads")}
    kueue_cluster = needs.kueue - kueue_ns
    cluster = render("--set", "kueue.enabled=true")
    assert rbac_needs.granted(operator_role(cluster)["rules"]) == needs.namespaced | needs.cluster | needs.kueue
    c = one(cluster, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "DDP_OPERATOR_KUEUE", "value": "true"} in c["env"]
    scoped = render("--set", "kueue.enabled=true", "--set", "rbac.scope=namespace", "--set", "watch.namespaces={team-a}")
    (role,) = by_kind(scoped, "Role")
    assert rbac_needs.granted(role["rules"]) == needs.namespaced | kueue_ns
    (kueue_role,) = operator_cluster_roles(scoped)
    assert rbac_needs.granted(kueue_role["rules"]) == kueue_cluster
    off = render()
    assert not any(r[0] == "kueue.x-k8s.io" for r in rbac_needs.granted(operator_role(off)["rules"]))


# --- the admission policy: only the operator puts the job labels on a pod ----------------------------------------
def _admission(objs):
    return one(objs, "ValidatingAdmissionPolicy"), one(objs, "ValidatingAdmissionPolicyBinding")


def test_admission_policy_guards_the_job_labels_by_default(render):
    """On by default: pods that carry the job labels (every label the job's NetworkPolicy and the operator select
    on, names.py) are refused on create, and on an update that adds or changes one, unless the chart's own
    ServiceAccount (or system:masters, who bypass authorization anyway) asks; failurePolicy Fail."""
    from ddp_operator import names
    policy, binding = _admission(render(release="ddp-operator", namespace="ddp-system"))
    assert policy["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert (rule["apiGroups"], rule["resources"], sorted(rule["operations"])) == ([""], ["pods"], ["CREATE", "UPDATE"])
    (allowed,) = spec["matchConditions"]
    assert '"system:serviceaccount:ddp-system:ddp-operator"' in allowed["expression"]
    assert '"system:masters"' in allowed["expression"]
    guarded = re.findall(r"'(ddp\.dev/[a-z-]+)'", spec["variables"][0]["expression"])
    assert sorted(guarded) == sorted([names.LABEL_JOB_NAME, names.LABEL_NODE_INDEX, names.LABEL_ROLE,
                                      names.LABEL_GROUP])
    (check,) = spec["validations"]
    assert check["expression"] == "size(variables.set) == 0" and check["reason"] == "Forbidden"
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}


def test_admission_policy_values_are_respected(render):
    objs = render("--set", "serviceAccount.name=op", "--set", "admissionPolicy.allowedUsers={alice,system:admin}",
                  "--set", "admissionPolicy.allowedGroups=null", "--set", "watch.namespaces={team-a,team-b}",
                  release="r", namespace="ops")
    policy, binding = _admission(objs)
    (allowed,) = policy["spec"]["matchConditions"]
    assert '["system:serviceaccount:ops:op","alice","system:admin"]' in allowed["expression"]
    assert "groups" not in allowed["expression"]
    # Only the watched namespaces are guarded: another release may run beside this one elsewhere.
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "team-b"]}]
    assert not by_kind(render("--set", "admissionPolicy.enabled=false"), "ValidatingAdmissionPolicy")
    assert not by_kind(render("--set", "admissionPolicy.enabled=false"), "ValidatingAdmissionPolicyBinding")


def test_admission_policy_needs_kubernetes_1_30(helm_bin):
    proc = run([helm_bin, "template", "x", str(CHART), "--kube-version", "1.29.5"], check=False)
    assert proc.returncode != 0 and "admissionPolicy.enabled=false" in proc.stderr, proc.stderr
    run([helm_bin, "template", "x", str(CHART), "--kube-version", "1.29.5", "--set", "admissionPolicy.enabled=false"])


def test_excluded_namespaces_are_left_to_others(render):
    """watch.exclude: one kopf pattern (a leading exclusion: every other namespace), and the admission policy skips
    those namespaces too, as another operator (e.g. the integration tests' own) handles them."""
    objs = render("--set", "watch.exclude={ddp-it-*,sand?x}")
    (deploy,) = by_kind(objs, "Deployment")
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=!ddp-it-*,!sand?x"], args
    policy, binding = _admission(objs)
    conditions = {c["name"]: c["expression"] for c in policy["spec"]["matchConditions"]}
    assert conditions["watched-namespace"] == '!request.namespace.matches("^(ddp-it-.*|sand.x)$")', conditions
    assert "matchResources" not in binding["spec"], binding
    # kopf lists and watches Namespaces to find those the globs leave to it (tests/rbac_needs.py)
    role = operator_role(objs)
    needs = rbac_needs.needs()
    assert rbac_needs.granted(role["rules"]) == needs.namespaced | needs.cluster | needs.patterns
    assert "watched-namespace" not in str(render()), "no exclusion by default"
