#!/usr/bin/env python3
"""Kueue (sigs.k8s.io/kueue, version KUEUE_VERSION of hack/versions.env) on the embedded cluster, so DDPJobs
can wait in Kueue queues.

    hack/kueue.py up        build what is missing, install or update the release, wait until Kueue's
                            webhooks answer; a few seconds when it is installed as configured here
    hack/kueue.py down      uninstall: the release, namespace kueue-system and Kueue's CRDs (every queue
                            and workload with them)
    hack/kueue.py status [--json]   release, pod, webhooks, configuration (exit 1 unless all are well)
    hack/kueue.py --kubeconfig PATH ...   another kubeconfig (default: the embedded cluster's)
    hack/kueue.py --kubeconfig PATH --kind-cluster NAME up   a kind cluster: the image goes in with `kind load`

What it owns, and where each piece comes from (nothing is pulled from a registry):
- the manager binary and Kueue's own Helm chart: `hack/build-binaries.sh kueue` builds
  sigs.k8s.io/kueue/cmd/kueue and copies charts/kueue from the same module into
  $DDPJOB_CACHE/kueue-$KUEUE_VERSION/{manager,chart/};
- the image localhost/kueue:$KUEUE_VERSION: hack/kueue/Dockerfile (FROM scratch + the static binary),
  built by hack/image.py with that cache directory as the context and imported into the embedded
  cluster's containerd, or loaded into a kind cluster's nodes (--kind-cluster); with --kubeconfig of any
  other cluster, its nodes must have that image already;
- the Helm release `kueue` in namespace kueue-system, with the values of `values()`: the local image
  (pullPolicy Never), one replica, small requests, no KueueViz/Prometheus/cert-manager (Kueue's internal
  certificate management, the chart's default), and the chart's own manager configuration with
  `integrations.externalFrameworks: [DDPJob.v1alpha1.ddp.dev]` added, so Kueue accepts Workloads owned
  by DDPJobs (the DDPJob operator creates and follows them; Kueue runs no webhook for DDPJobs).

Kueue's on-demand visibility API (pending workloads, an aggregated API: APIServices
v1beta{1,2}.visibility.kueue.x-k8s.io) is left out: the feature gate VisibilityOnDemand is off and this
script, as Helm's post-renderer, drops the two APIService objects from the release. The embedded
cluster's API server runs without the aggregation layer's front-proxy configuration
(--proxy-client-cert-file, --requestheader-*), so it forwards aggregated requests anonymously and Kueue's
visibility server refuses even its discovery (403). An APIService that is not Available makes API
discovery incomplete, and the namespace controller then refuses to finish deleting any namespace
(NamespaceDeletionDiscoveryFailure): every namespace deletion in the cluster would hang. Queues,
admission and preemption do not depend on that API; `kubectl get workloads,clusterqueues` shows them.

Integrations: FRAMEWORKS (batch/v1 Jobs) plus DDPJob as an external framework, not the chart's long default
list: its pod, deployment and statefulset integrations put Kueue's webhooks in the path of every pod created in
the cluster (failurePolicy Fail for pods), so a Kueue hiccup would block pod creation everywhere. Kueue lists and
watches DDPJobs, the owners of their Workloads: `up` applies manifests/kueue/ddpjob-access.yaml, without which
Kueue's cache of DDPJobs never syncs and its webhooks that look a pod's owner up stall.

Standard library only, like hack/common.py and hack/image.py, whose helpers it uses.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a script (python hack/kueue.py): hack.* from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hack import common, image  # noqa: E402
# The release's paths, values and post-renderer (pure: hack/kueue_values.py); every name stays importable from here.
from hack.kueue_values import (  # noqa: E402,F401
    DDPJOB_FRAMEWORK, FEATURE_GATES, FRAMEWORKS, IMAGE_REPO, KueueError, build_dir, chart_dir, chart_manager_config,
    image_ref, manager_config, post_render, values, version,
)

HACK = Path(__file__).resolve().parent
DOCKERFILE = HACK / "kueue" / "Dockerfile"
ACCESS = HACK.parent / "manifests" / "kueue" / "ddpjob-access.yaml"
RELEASE = "kueue"
NAMESPACE = "kueue-system"
CRD_GROUP = "kueue.x-k8s.io"
LOCK = common.CACHE / "kueue.lock"
# The chart's labels on everything it creates (cluster-scoped leftovers are found by it in `down`).
CHART_SELECTOR = f"app.kubernetes.io/name=kueue,app.kubernetes.io/instance={RELEASE}"
HELM_TIMEOUT = "5m"
WEBHOOK_TIMEOUT = 120.0
# A throwaway object for the webhook probe: a server-side dry run goes through Kueue's mutating and
# validating webhooks (and the API server's call to its Service) and stores nothing.
PROBE = {"apiVersion": f"{CRD_GROUP}/v1beta2", "kind": "ResourceFlavor",
         "metadata": {"name": "kueue-py-webhook-probe"}, "spec": {}}


log = common.logger("kueue")


# --------------------------------------------------------------------------------------------
# where things are

def helm(kubeconfig: Path, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    return common.run([common.binary("helm"), f"--kubeconfig={kubeconfig}", *args], check=check,
                       timeout=timeout, quiet=True)


def kubectl(kubeconfig: Path, *args: str, check: bool = True, input: str | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
    return common.run([common.binary("kubectl"), f"--kubeconfig={kubeconfig}", *args], check=check,
                       input=input, timeout=timeout, quiet=True)


@contextlib.contextmanager
def _locked():
    """One up/down at a time per machine (parallel test sessions may all call up)."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


# --------------------------------------------------------------------------------------------
# binary, chart, image

def ensure_build() -> None:
    """The manager binary and the chart, from hack/build-binaries.sh's cache (built on first use)."""
    if (build_dir() / "manager").exists() and (chart_dir() / "Chart.yaml").exists():
        return
    log(f"building the Kueue {version()} manager and copying its chart (hack/build-binaries.sh kueue)")
    p = subprocess.run([str(HACK / "build-binaries.sh"), "kueue"])
    if p.returncode != 0:
        raise KueueError(f"hack/build-binaries.sh kueue failed (exit {p.returncode}); its output is above")


def ensure_image(kind_cluster: str | None = None, kind: str = "kind") -> str:
    """localhost/kueue:$KUEUE_VERSION in the embedded cluster's containerd, or on every node of kind cluster
    `kind_cluster` (built with buildah, streamed into the nodes: image.kind_load); returns its manifest digest."""
    ref = image_ref()
    if kind_cluster:
        digest = image.build(DOCKERFILE, ref, build_dir(), to_containerd_ns=False)
        log(f"loading {ref} into kind cluster {kind_cluster}")
        image.kind_load(ref, kind_cluster, kind=kind)
        return digest
    digest = image.containerd_images().get(ref)
    if digest:
        return digest
    log(f"building {ref} from {DOCKERFILE.relative_to(common.REPO)} (context {build_dir()})")
    return image.build(DOCKERFILE, ref, build_dir())


# --------------------------------------------------------------------------------------------
# the release

def release(kubeconfig: Path) -> dict | None:
    """The release as `helm list` shows it (status, revision, app_version...), None when not installed."""
    p = helm(kubeconfig, "list", "-n", NAMESPACE, "--filter", f"^{RELEASE}$", "--all", "-o", "json")
    return next(iter(json.loads(p.stdout or "[]")), None)


def installed_as(kubeconfig: Path, want: dict) -> bool:
    """The release is deployed, from this Kueue version's chart, with exactly these values."""
    rel = release(kubeconfig)
    if not rel or rel["status"] != "deployed" or rel["app_version"] != version():
        return False
    got = helm(kubeconfig, "get", "values", RELEASE, "-n", NAMESPACE, "-o", "json", check=False)
    if got.returncode != 0 or json.loads(got.stdout or "null") != want:
        return False
    return not apiservices(kubeconfig)  # a release installed without the post-renderer has them


def helm_install(kubeconfig: Path, vals: dict) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="kueue-values-") as f:
        json.dump(vals, f)  # JSON is YAML: helm reads it as a values file
        f.flush()
        p = helm(kubeconfig, "upgrade", "--install", RELEASE, str(chart_dir()), "-n", NAMESPACE,
                 "--create-namespace", "--wait", "--timeout", HELM_TIMEOUT, "-f", f.name,
                 "--post-renderer", str(Path(__file__).resolve()), "--post-renderer-args", "post-render",
                 check=False, timeout=360)
    if p.returncode != 0:
        raise KueueError(f"helm upgrade --install {RELEASE} failed:\n{p.stderr.strip() or p.stdout.strip()}\n"
                         + pod_report(kubeconfig))


def pod_report(kubeconfig: Path) -> str:
    """The manager pods and the tail of their log: what a failed install is explained by."""
    pods = kubectl(kubeconfig, "-n", NAMESPACE, "get", "pods", "-o", "wide", check=False).stdout.strip()
    logs = kubectl(kubeconfig, "-n", NAMESPACE, "logs", "deploy/kueue-controller-manager", "--tail=20",
                   check=False)
    return f"--- pods in {NAMESPACE} ---\n{pods}\n--- manager log ---\n{(logs.stdout or logs.stderr).strip()}"


def webhooks_answer(kubeconfig: Path) -> tuple[bool, str]:
    p = kubectl(kubeconfig, "create", "--dry-run=server", "-o", "name", "-f", "-", input=json.dumps(PROBE),
                check=False, timeout=30)
    return p.returncode == 0, (p.stderr or p.stdout).strip()


def wait_webhooks(kubeconfig: Path, timeout: float = WEBHOOK_TIMEOUT) -> float:
    """Until the API server gets an answer from Kueue's webhook Service; returns the seconds waited."""
    t0 = time.monotonic()
    last = ""
    while time.monotonic() - t0 < timeout:
        ok, last = webhooks_answer(kubeconfig)
        if ok:
            return time.monotonic() - t0
        time.sleep(1)
    raise KueueError(f"Kueue's webhooks did not answer within {timeout:.0f}s (a dry-run create of a "
                     f"ResourceFlavor): {last}\n{pod_report(kubeconfig)}")


def apiservices(kubeconfig: Path) -> dict[str, str]:
    """Kueue's aggregated APIs (the visibility server) -> their Available condition ('True'/'False: why')."""
    p = kubectl(kubeconfig, "get", "apiservices", "-l", CHART_SELECTOR, "-o", "json", check=False)
    out = {}
    for item in json.loads(p.stdout).get("items", []) if p.returncode == 0 else []:
        cond = next((c for c in item.get("status", {}).get("conditions", []) if c["type"] == "Available"), {})
        state = cond.get("status", "Unknown")
        out[item["metadata"]["name"]] = state if state == "True" else f"{state}: {cond.get('message', '')}"
    return out


def _cluster_reachable(kubeconfig: Path) -> None:
    if not Path(kubeconfig).exists():
        raise KueueError(f"{kubeconfig} does not exist: start the cluster first (make cluster-up)")
    p = kubectl(kubeconfig, "get", "--raw", "/readyz", check=False, timeout=15)
    if p.returncode != 0:
        raise KueueError(f"the cluster of {kubeconfig} is not ready (make cluster-up?): {p.stderr.strip()}")


# --------------------------------------------------------------------------------------------
# up / down / status

def up(kubeconfig: Path | str = common.KUBECONFIG, kind_cluster: str | None = None,
       kind: str = "kind") -> dict[str, float]:
    """Install Kueue or bring the release to the configuration above; returns the seconds per stage.
    `kind_cluster`: the kubeconfig's cluster is that kind cluster, whose nodes get the image by `kind load`."""
    kubeconfig = Path(kubeconfig)
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    with _locked():
        _cluster_reachable(kubeconfig)
        ensure_build()
        timings["build"] = time.monotonic() - t0
        digest = ensure_image(kind_cluster, kind)
        timings["image"] = time.monotonic() - t0 - timings["build"]
        want = values(digest)
        t1 = time.monotonic()
        if installed_as(kubeconfig, want):
            log(f"release {RELEASE} in {NAMESPACE} is up to date")
        else:
            log(f"helm upgrade --install {RELEASE} (chart {version()}, image {image_ref()}) in {NAMESPACE}")
            helm_install(kubeconfig, want)
        # Kueue lists and watches the DDPJobs that own its Workloads (manifests/kueue/ddpjob-access.yaml).
        kubectl(kubeconfig, "apply", "-f", str(ACCESS))
        timings["helm"] = time.monotonic() - t1
        timings["webhooks"] = wait_webhooks(kubeconfig)
        left = [name for name, state in apiservices(kubeconfig).items() if state != "True"]
        if left:  # not from this script's release; while unavailable, namespace deletions hang
            log(f"deleting Kueue's unavailable APIServices {', '.join(left)} (see hack/kueue.py's docstring)")
            kubectl(kubeconfig, "delete", "apiservice", *left, "--ignore-not-found")
    timings["total"] = time.monotonic() - t0
    log(f"Kueue {version()} is up in {timings['total']:.1f}s ("
        + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items() if k != "total") + ")")
    return timings


def _kueue_crds(kubeconfig: Path) -> list[str]:
    out = kubectl(kubeconfig, "get", "crd", "-o", "name", check=False).stdout.split()
    return [n.split("/", 1)[1] for n in out if n.endswith(f".{CRD_GROUP}")]


def _drop_finalizers(kubeconfig: Path, crd: str) -> None:
    """Kueue's objects carry its finalizers; with the manager gone nobody else removes them."""
    p = kubectl(kubeconfig, "get", crd, "-A", "-o", "json", check=False)
    for item in json.loads(p.stdout).get("items", []) if p.returncode == 0 else []:
        if item["metadata"].get("finalizers"):
            ns = item["metadata"].get("namespace")
            kubectl(kubeconfig, "patch", crd, item["metadata"]["name"], *(["-n", ns] if ns else []),
                    "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False)


def down(kubeconfig: Path | str = common.KUBECONFIG) -> None:
    """Uninstall Kueue and everything it defined; a no-op when it is not installed."""
    kubeconfig = Path(kubeconfig)
    t0 = time.monotonic()
    with _locked():
        _cluster_reachable(kubeconfig)
        # The webhooks go first: with failurePolicy Fail, a webhook left without its pod refuses Pods.
        kubectl(kubeconfig, "delete", "mutatingwebhookconfiguration,validatingwebhookconfiguration,apiservice",
                "-l", CHART_SELECTOR, "--ignore-not-found", "--wait=false", check=False)
        if release(kubeconfig):
            log(f"helm uninstall {RELEASE} -n {NAMESPACE}")
            p = helm(kubeconfig, "uninstall", RELEASE, "-n", NAMESPACE, check=False, timeout=180)
            if p.returncode != 0:
                raise KueueError(f"helm uninstall {RELEASE} failed:\n{p.stderr.strip()}")
        crds = _kueue_crds(kubeconfig)
        for crd in crds:
            _drop_finalizers(kubeconfig, crd)
        if crds:
            log(f"deleting {len(crds)} Kueue CRDs")
            kubectl(kubeconfig, "delete", "crd", *crds, "--ignore-not-found", "--wait=false", check=False)
        # Cluster-scoped leftovers of a release helm no longer knows (a failed install, say).
        kubectl(kubeconfig, "delete", "clusterrole,clusterrolebinding", "-l", CHART_SELECTOR,
                "--ignore-not-found", check=False)
        deadline = time.monotonic() + 120
        while (left := _kueue_crds(kubeconfig)) and time.monotonic() < deadline:
            for crd in left:  # objects created after the first pass (a controller racing the uninstall)
                _drop_finalizers(kubeconfig, crd)
            time.sleep(1)
        if left:
            raise KueueError(f"Kueue's CRDs are still there after 120s: {', '.join(left)}")
        p = kubectl(kubeconfig, "delete", "namespace", NAMESPACE, "--ignore-not-found", "--timeout=120s",
                    check=False, timeout=150)
        if p.returncode != 0:
            raise KueueError(f"namespace {NAMESPACE} was not deleted: {p.stderr.strip()}")
    log(f"Kueue is down ({time.monotonic() - t0:.1f}s)")


def status(kubeconfig: Path | str = common.KUBECONFIG) -> dict:
    kubeconfig = Path(kubeconfig)
    _cluster_reachable(kubeconfig)
    rel = release(kubeconfig)
    st: dict = {"version": version(), "image": image_ref(), "release": None, "pods": [], "webhooks": None,
                "apiservices": {}, "external_frameworks": []}
    if rel:
        st["release"] = {"status": rel["status"], "revision": rel["revision"], "app_version": rel["app_version"]}
        pods = kubectl(kubeconfig, "-n", NAMESPACE, "get", "pods", "-l", CHART_SELECTOR, "-o", "json",
                       check=False)
        for pod in json.loads(pods.stdout).get("items", []) if pods.returncode == 0 else []:
            ready = next((c["status"] for c in pod["status"].get("conditions", []) if c["type"] == "Ready"), "")
            st["pods"].append({"name": pod["metadata"]["name"], "phase": pod["status"].get("phase"),
                               "ready": ready == "True"})
        st["webhooks"] = webhooks_answer(kubeconfig)[0]
        st["apiservices"] = apiservices(kubeconfig)
        cm = kubectl(kubeconfig, "-n", NAMESPACE, "get", "configmap", "kueue-manager-config", "-o",
                     "jsonpath={.data.controller_manager_config\\.yaml}", check=False).stdout
        st["external_frameworks"] = [DDPJOB_FRAMEWORK] if DDPJOB_FRAMEWORK in cm else []
    st["ok"] = bool(rel and st["release"]["status"] == "deployed" and st["pods"]
                    and all(p["ready"] for p in st["pods"]) and st["webhooks"]
                    and all(v == "True" for v in st["apiservices"].values()))
    return st


def print_status(st: dict) -> None:
    if not st["release"]:
        print(f"Kueue {st['version']} is not installed (hack/kueue.py up)")
        return
    r = st["release"]
    print(f"release {RELEASE} in {NAMESPACE}: {r['status']}, revision {r['revision']}, Kueue {r['app_version']}")
    for p in st["pods"]:
        print(f"  pod {p['name']}: {p['phase']}, {'ready' if p['ready'] else 'NOT ready'}")
    print(f"  webhooks answer: {'yes' if st['webhooks'] else 'NO'}")
    for name, state in st["apiservices"].items():
        print(f"  APIService {name}: {'available' if state == 'True' else state}")
    print(f"  external frameworks: {', '.join(st['external_frameworks']) or 'none'}")
    print("Kueue is UP" if st["ok"] else "Kueue is NOT healthy")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kubeconfig", default=str(common.KUBECONFIG), help="default: the embedded cluster's")
    ap.add_argument("--kind-cluster", default="", help="the kubeconfig's cluster is this kind cluster: `up` loads "
                                                        "the image into its nodes")
    ap.add_argument("--kind", default="kind", help="the kind binary (with --kind-cluster)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up")
    sub.add_parser("down")
    s = sub.add_parser("status")
    s.add_argument("--json", action="store_true")
    sub.add_parser("post-render", help="Helm's post-renderer (reads the rendered release on stdin)")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "up":
            if os.geteuid() != 0:
                raise KueueError("hack/kueue.py up needs root (image builds: buildah, containerd)")
            up(a.kubeconfig, a.kind_cluster or None, a.kind)
        elif a.cmd == "down":
            down(a.kubeconfig)
        elif a.cmd == "post-render":
            sys.stdout.write(post_render(sys.stdin.read()))
        elif a.cmd == "status":
            st = status(a.kubeconfig)
            print(json.dumps(st, indent=2)) if a.json else print_status(st)
            return 0 if st["ok"] else 1
    except (KueueError, common.ClusterError, common.BuildError, subprocess.CalledProcessError) as e:
        print(f"\nERROR: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
