"""`python -m ddp_operator`: run the operator (kopf) with metrics, liveness, logging and leader election.

Every flag has an environment variable (shown in --help) so the Deployment can configure it either way.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import uuid

import kopf

from ddp_operator import __version__, job_metrics, kopf_mends, leader, memory, metrics, names, probes
from ddp_operator.diagnostics import DEFAULT_TOOLS_IMAGE, Tools
from ddp_operator.rdzv_spec import DEFAULT_STORE_IMAGE, valid_image
from ddp_operator.netpol import NetworkPolicyConfig, parse_labels


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddp_operator", description="The DDPJob operator.")
    p.add_argument("--namespace", action="append", default=None,
                   help="watch only this namespace (repeatable; env DDP_OPERATOR_NAMESPACES, comma-separated); "
                        "default: all namespaces")
    p.add_argument("--metrics-port", type=int, default=int(_env("DDP_OPERATOR_METRICS_PORT",
                                                                str(names.DEFAULT_METRICS_PORT))),
                   help="Prometheus /metrics port, 0 to disable (env DDP_OPERATOR_METRICS_PORT)")
    p.add_argument("--liveness-port", type=int, default=int(_env("DDP_OPERATOR_LIVENESS_PORT",
                                                                 str(names.DEFAULT_LIVENESS_PORT))),
                   help="liveness endpoint http://0.0.0.0:PORT/healthz, 0 to disable (env DDP_OPERATOR_LIVENESS_PORT)")
    p.add_argument("--readiness-port", type=int, default=int(_env("DDP_OPERATOR_READINESS_PORT",
                                                                  str(names.DEFAULT_READINESS_PORT))),
                   help="readiness endpoint http://0.0.0.0:PORT/readyz, 200 only in the replica that acts (the "
                        "leader, once started), 0 to disable (env DDP_OPERATOR_READINESS_PORT)")
    p.add_argument("--log-format", choices=("text", "json"), default=_env("DDP_OPERATOR_LOG_FORMAT", "text"),
                   help="log format (env DDP_OPERATOR_LOG_FORMAT)")
    p.add_argument("--verbose", action="store_true", default=_env("DDP_OPERATOR_VERBOSE", "") == "1",
                   help="debug logging (env DDP_OPERATOR_VERBOSE=1)")
    p.add_argument("--leader-elect", action="store_true",
                   default=_env("DDP_OPERATOR_LEADER_ELECT", "") in ("1", "true"),
                   help="run as one of several replicas; only the holder of a Lease reconciles "
                        "(env DDP_OPERATOR_LEADER_ELECT=true)")
    p.add_argument("--lease-namespace", default=_env("POD_NAMESPACE", "default"),
                   help="namespace of the Lease (env POD_NAMESPACE)")
    p.add_argument("--lease-name", default=_env("DDP_OPERATOR_LEASE_NAME", "ddp-operator"),
                   help="name of the Lease (env DDP_OPERATOR_LEASE_NAME)")
    p.add_argument("--network-policy", choices=("true", "false"),
                   default=_env("DDP_OPERATOR_NETWORK_POLICY", "true").lower(),
                   help="give every DDPJob a NetworkPolicy unless its spec.networkPolicy.enabled says otherwise "
                        "(env DDP_OPERATOR_NETWORK_POLICY); false for clusters whose CNI enforces none")
    p.add_argument("--operator-pod-labels", default=_env("DDP_OPERATOR_POD_LABELS", ""),
                   help="labels of the operator's own pods, k=v[,k=v]: the jobs' NetworkPolicies let these pods "
                        "(in $POD_NAMESPACE) reach the progress port (env DDP_OPERATOR_POD_LABELS); empty when "
                        "the operator runs outside the cluster")
    p.add_argument("--kueue", choices=("true", "false"), default=_env("DDP_OPERATOR_KUEUE", "false").lower(),
                   help="run DDPJobs labelled kueue.x-k8s.io/queue-name behind Kueue: one Workload per job, pods "
                        "only while Kueue admits it (env DDP_OPERATOR_KUEUE); needs Kueue's CRDs and RBAC for "
                        "workloads, resourceflavors and workloadpriorityclasses")
    p.add_argument("--diagnostics-image", default=_env(names.ENV_DIAGNOSTICS_IMAGE, "") or DEFAULT_TOOLS_IMAGE,
                   help="image the diagnostics sidecar's init container copies py-spy and the server from: the "
                        f"operator's own (env {names.ENV_DIAGNOSTICS_IMAGE}; default {DEFAULT_TOOLS_IMAGE})")
    p.add_argument("--diagnostics-image-pull-policy", choices=("", "Always", "IfNotPresent", "Never"),
                   default=_env(names.ENV_DIAGNOSTICS_IMAGE_PULL_POLICY, ""),
                   help="its imagePullPolicy; empty: the kubelet's default "
                        f"(env {names.ENV_DIAGNOSTICS_IMAGE_PULL_POLICY})")
    p.add_argument("--store-image", default=_env(names.ENV_STORE_IMAGE, "") or DEFAULT_STORE_IMAGE,
                   help="image of the rendezvous-store pod <job>-rdzv of every job whose spec.rendezvous.image names "
                        f"none (env {names.ENV_STORE_IMAGE}; default {DEFAULT_STORE_IMAGE})")
    p.add_argument("--version", action="version", version=f"ddp-operator {__version__}")
    args = p.parse_args(argv)
    if not valid_image(args.store_image):
        p.error(f"--store-image: {args.store_image!r} is not an image reference")
    if args.namespace is None:
        env = _env("DDP_OPERATOR_NAMESPACES", "")
        args.namespace = [n.strip() for n in env.split(",") if n.strip()]
    return args


# kopf's namespace-pattern syntax: globs (* ?), negations (!) and comma-separated lists.
_PATTERN_CHARS = frozenset("*?!,")


def exact_namespaces(namespaces: list[str]) -> bool:
    """True if the operator serves only namespaces named exactly, so kopf need not scan the cluster.

    kopf otherwise lists and watches Namespaces and CRDs cluster-wide, which namespace-scoped RBAC (the chart's
    rbac.scope=namespace) forbids; the 403s are retried for about a minute before kopf falls back to the very
    same names. Globs do need the namespace scan to find matching namespaces.
    """
    return bool(namespaces) and not any(_PATTERN_CHARS & set(n) for n in namespaces)


def settings_for(namespaces: list[str]) -> kopf.OperatorSettings:
    """kopf settings that depend on the command line (the rest are set in handlers.configure)."""
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = exact_namespaces(namespaces)
    return settings


def network_policy_config(args: argparse.Namespace) -> NetworkPolicyConfig:
    """What the jobs' NetworkPolicies need to know about this operator (see netpol.py)."""
    try:
        labels = parse_labels(args.operator_pod_labels)
    except ValueError as e:
        raise SystemExit(f"--operator-pod-labels: {e}") from None
    return NetworkPolicyConfig(enabled_by_default=args.network_policy == "true",
                               operator_namespace=_env("POD_NAMESPACE", "") if labels else "",
                               operator_labels=labels)


def diagnostics_tools(args: argparse.Namespace) -> Tools:
    """The diagnostics tools image every trainer pod's init container runs (diagnostics.py)."""
    return Tools(image=args.diagnostics_image, pull_policy=args.diagnostics_image_pull_policy or None)


def job_bodies(memo: kopf.Memo, tries: int = 3) -> list:
    """The DDPJob bodies in kopf's index (none before the startup handler made the Reconciler, nor on a standby).

    Called from the metrics server's thread while kopf's loop changes the index: a listing that met a change is
    taken again (RuntimeError: dictionary changed size during iteration), at most `tries` times."""
    r = memo.get("reconciler")
    if r is None:
        return []
    for attempt in range(tries):
        try:
            keys = r.jobs.keys()
            break
        except RuntimeError:
            if attempt == tries - 1:
                raise
    return [b for b in map(r.jobs.body, keys) if b is not None]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "MALLOC_ARENA_MAX" not in os.environ:  # the user's own setting wins (glibc reads it at start)
        memory.limit_arenas()  # before any thread starts (memory.py)
    memory.start_trimming(threading.Event())
    kopf.configure(verbose=args.verbose,
                   log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.FULL)
    log = logging.getLogger("ddp_operator")
    if not args.verbose:
        # kopf logs every handler run at INFO; our reconciler logs what it does instead.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    from ddp_operator import handlers  # registers the kopf handlers
    from ddp_operator.jobs import kept_child, kept_pod, without_managed_fields
    from ddp_operator.reconciler import Config

    # What kopf queues of each object: only what the operator reads (kopf_mends, "kopf holds every object's body");
    # the children a restart lists are only indexed: their job's resume pass acts on them (kopf_mends, "every object
    # listed at the start waits").
    policies = (names.NETWORK_POLICY_API_VERSION.split("/")[0], "networkpolicies")
    kopf_mends.apply(slimmers={("", "pods"): kept_pod, ("", "services"): kept_child, policies: kept_child,
                               (names.GROUP, names.PLURAL): without_managed_fields},
                     listed_children={("", "pods"), ("", "services"), policies,
                                      (names.KUEUE_GROUP, names.WORKLOAD_PLURAL)})

    config = Config(network_policy=network_policy_config(args), kueue=args.kueue == "true",
                    diagnostics=diagnostics_tools(args), store_image=args.store_image)
    if config.kueue:
        handlers.enable_kueue()

    # The per-job metrics (job_metrics.py), read from the memo's Reconciler at scrape time; the job handlers show
    # them every job event (handlers.on_job_event) so that no recovery waits for a scrape to be observed.
    operator_memo = handlers.memo(config)
    operator_memo.job_metrics = job_metrics.register(lambda: job_bodies(operator_memo))
    metrics.serve(args.metrics_port)
    started = threading.Event()  # kopf ran the startup handlers (kopf.run's ready flag)

    def readiness() -> probes.Readiness:
        fence = leader.write_fence()
        return probes.decide(leader_election=args.leader_elect, lease_left=fence() if fence else 0.0,
                             started=started.is_set())
    probes.serve(args.readiness_port, readiness)
    if args.leader_elect:
        from ddp_operator.k8s import Api
        from ddp_operator.leader import LeaderElector
        # Unique even for two replicas on one host (as client-go does): a shared identity would let both lead.
        identity = os.environ.get("POD_NAME") or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
        standby = probes.standby_liveness(args.liveness_port)
        LeaderElector(Api(), args.lease_namespace, args.lease_name, identity).acquire()
        if standby is not None:
            standby.shutdown()
            standby.server_close()  # kopf's liveness endpoint takes the port over
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    scope = ", ".join(args.namespace) if args.namespace else "all namespaces"
    log.info("ddp-operator %s watching %s", __version__, scope)
    kopf.run(
        settings=settings_for(args.namespace),
        standalone=True,  # two replicas are kept apart by --leader-elect, not kopf peering
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=liveness,
        memo=operator_memo,
        ready_flag=started,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
