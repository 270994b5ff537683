"""The RBAC the operator needs, derived from its code, for the tests that compare it with what the chart and the
manifests grant.

Three sources, each read from the code rather than restated:
- operator/ddp_operator/k8s.py, the only module with client calls: every `self.<api>.<method>(...)`, with
  `<api>` one of the kubernetes client classes built in `Api.__init__`. The method name says the verb and the
  resource (`create_namespaced_network_policy` -> create networkpolicies; `list_node(watch=True)` -> watch nodes). Calls inside the methods that
  leader.py uses are the leader-election needs (a Role in the release namespace); calls on non-namespaced
  resources need a ClusterRole.
- operator/ddp_operator/handlers.py, the kopf registrations: every watched or indexed resource needs list and
  watch; resources with change-detecting handlers (on.create/update/resume...) also need patch, for kopf's
  bookkeeping annotations.
- What kopf and the API server need beyond those calls, each stated once below with its reason.
The Kueue integration's needs (custom-object calls on the Kueue group, the Workload watch that
handlers.enable_kueue registers) are apart: the chart grants them only with kueue.enabled.

A rule is (apiGroup, resource, verb).
"""

from __future__ import annotations

import ast
import importlib
import re
from dataclasses import dataclass, field

from tests import tools

OPERATOR = tools.REPO_ROOT / "operator" / "ddp_operator"

# kubernetes client API classes -> API group. A class missing here fails the derivation (and so the test).
API_GROUPS = {
    "CoreV1Api": "",
    "CoordinationV1Api": "coordination.k8s.io",
    "NetworkingV1Api": "networking.k8s.io",
    "CustomObjectsApi": None,  # the group is the DDPJob's (names.GROUP)
}
# Client method prefixes -> RBAC verbs.
VERBS = {"create": "create", "read": "get", "get": "get", "replace": "update", "patch": "patch", "delete": "delete",
         "list": "list", "delete_collection": "deletecollection"}
_METHOD = re.compile(r"^(delete_collection|create|read|get|replace|patch|delete|list)_(namespaced_|cluster_)?(.+?)"
                     r"(_status)?$")
# Change-detecting kopf handlers: kopf patches the object to record progress and the last handled state.
_PATCHING_HANDLERS = {"create", "update", "resume", "delete", "field"}


def plural(snake: str) -> str:
    """Client method resource names are singular snake_case: network_policy -> networkpolicies."""
    word = snake.replace("_", "")
    if word.endswith("y"):
        return word[:-1] + "ies"
    return word + "s"


@dataclass
class Needs:
    namespaced: set[tuple[str, str, str]] = field(default_factory=set)  # in every watched namespace
    cluster: set[tuple[str, str, str]] = field(default_factory=set)     # only a ClusterRole can grant
    leader: set[tuple[str, str, str]] = field(default_factory=set)      # the Lease, release namespace
    kueue: set[tuple[str, str, str]] = field(default_factory=set)       # only with the Kueue integration
    patterns: set[tuple[str, str, str]] = field(default_factory=set)    # only with namespace globs (watch.exclude)
    calls: list[str] = field(default_factory=list)                      # every client call found


def _api_attributes(tree: ast.Module) -> dict[str, str]:
    """`self.core = client.CoreV1Api(...)` -> {"core": "CoreV1Api"}."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            cls = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if cls and cls.endswith("Api") and cls != "ApiClient":
                for target in node.targets:
                    if isinstance(target, ast.Attribute):
                        out[target.attr] = cls
    return out


def _leader_methods() -> set[str]:
    """Api methods leader.py calls (`self.api.<name>(...)`)."""
    tree = ast.parse((OPERATOR / "leader.py").read_text())
    return {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Attribute) and n.func.value.attr == "api"}


def _client_calls(needs: Needs, names) -> None:
    tree = ast.parse((OPERATOR / "k8s.py").read_text())
    attrs = _api_attributes(tree)
    leader = _leader_methods()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for call in ast.walk(fn):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and isinstance(call.func.value, ast.Attribute) and call.func.value.attr in attrs):
                continue
            cls, method = attrs[call.func.value.attr], call.func.attr
            if cls not in API_GROUPS:
                raise AssertionError(f"k8s.py uses {cls}: add its API group to tests/rbac_needs.py")
            m = _METHOD.match(method)
            if not m:
                raise AssertionError(f"k8s.py calls {cls}.{method}: not a verb_resource client method")
            verb, namespaced, resource, status = m.groups()
            namespaced = namespaced if namespaced != "cluster_" else None
            group = API_GROUPS[cls]
            kueue = False
            if cls == "CustomObjectsApi":  # (group, version, [namespace,] plural, ...) as names.* constants
                scope = {"names": names}
                group = eval(compile(ast.Expression(call.args[0]), "<rbac>", "eval"), scope)
                resource = eval(compile(ast.Expression(call.args[3 if namespaced else 2]), "<rbac>", "eval"), scope)
                kueue = group == names.KUEUE_GROUP
            else:
                resource = plural(resource)
            if status:
                resource += "/status"
            rules = {(group, resource, VERBS[verb])}
            if verb == "list" and any(k.arg == "watch" and isinstance(k.value, ast.Constant) and k.value.value is True
                                      for k in call.keywords):  # list_*(watch=True) is a watch
                rules = {(group, resource, "watch")}
            needs.calls.append(f"{fn.name}: {cls}.{method}")
            if kueue:
                needs.kueue |= rules
            elif fn.name in leader:
                needs.leader |= rules
            elif namespaced:
                needs.namespaced |= rules
            else:
                needs.cluster |= rules


def _literal(node: ast.AST, module) -> list[str]:
    if isinstance(node, ast.Constant):
        return [node.value]
    if isinstance(node, ast.Starred):
        return list(eval(compile(ast.Expression(node.value), "<rbac>", "eval"), vars(module)))
    return [eval(compile(ast.Expression(node), "<rbac>", "eval"), vars(module))]


def _resource(args: list[str]) -> tuple[str, str]:
    """kopf's resource spec -> (group, plural): (group, version, plural), (version, plural) for the core group,
    or one "plural.group" / "plural.version.group" string."""
    if len(args) == 3:
        return args[0], args[2]
    if len(args) == 2:
        return ("", args[1]) if "/" not in args[0] else (args[0].split("/")[0], args[1])
    plural_, _, rest = args[0].partition(".")
    group = rest.split(".", 1)[1] if re.match(r"^v\d", rest) else rest
    return group, plural_


def _kopf_registrations(needs: Needs) -> None:
    module = importlib.import_module("ddp_operator.handlers")
    tree = ast.parse((OPERATOR / "handlers.py").read_text())
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for deco in fn.decorator_list:
            if not isinstance(deco, ast.Call):
                continue
            dotted = ast.unparse(deco.func)
            if not dotted.startswith("kopf.") or dotted in ("kopf.on.startup", "kopf.on.cleanup", "kopf.on.login",
                                                            "kopf.on.probe"):
                continue
            args = [v for a in deco.args for v in _literal(a, module)]
            group, res = _resource(args)
            needs.namespaced |= {(group, res, "list"), (group, res, "watch")}
            if dotted.split(".")[-1] in _PATCHING_HANDLERS:
                needs.namespaced.add((group, res, "patch"))


def needs() -> Needs:
    """Everything the operator's code needs, split by where the chart must grant it."""
    from ddp_operator import labels, names
    from ddp_operator.spec import parse_job

    from ddp_operator import handlers

    n = Needs()
    _client_calls(n, names)
    _kopf_registrations(n)
    # handlers.enable_kueue registers an index and an event handler on the Workloads (no decorators to read).
    group, _, res = handlers.WORKLOADS
    n.kueue |= {(group, res, "list"), (group, res, "watch")}
    # Children carry owner references with blockOwnerDeletion; where the OwnerReferencesPermissionEnforcement
    # admission plugin is on, setting it needs update on the owner's finalizers subresource.
    job = parse_job({"metadata": {"name": "j", "namespace": "n", "uid": "u"},
                     "spec": {"nodes": 1, "template": {"spec": {"containers": [{"name": "trainer"}]}}}})
    if labels.owner_reference(job).get("blockOwnerDeletion"):
        n.namespaced.add((names.GROUP, f"{names.PLURAL}/finalizers", "update"))
    # kopf, run cluster-wide (no exact namespaces: __main__.exact_namespaces), scans CRDs so that it notices
    # the DDPJob CRD being (re)installed without a restart.
    n.cluster |= {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")}
    # kopf, given namespace globs (the chart's watch.exclude), lists and watches Namespaces to find those that match.
    n.patterns |= {("", "namespaces", v) for v in ("list", "watch")}
    return n


def granted(rules: list[dict]) -> set[tuple[str, str, str]]:
    """An RBAC rules list as (group, resource, verb) triples."""
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
