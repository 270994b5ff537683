"""`kubectl ddp`: the argument parser and the dispatch to one module per command.

kubectl runs `kubectl-ddp` from PATH with every argument after `ddp`, so the flags kubectl users type (`-n`,
`--context`, `--kubeconfig`, `-o`, `-A`) are this parser's own and mean what they mean to kubectl.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

from kubectl_ddp.kube import CliError, connect, server_error, unreachable
from kubectl_ddp.run import DEFAULT_IMAGE

EXAMPLES = """\
Examples:
  # Train a script on 2 nodes in the stock trainer image, and follow it to the end
  kubectl ddp run train.py --nodes 2 -- --epochs 10

  # All jobs in the namespace, refreshed; one job's pods, attempts and last recovery
  kubectl ddp top
  kubectl ddp top digits

  # Every rank's log merged in time order, following replaced and restarted pods
  kubectl ddp logs digits -f

  # The loss against step as a PNG, or in the terminal
  kubectl ddp plot digits -o loss.png
  kubectl ddp plot digits
"""


def _count(least: int):
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < least:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least {least}")
        return int(text)
    return parse


def _nproc(text: str) -> str:
    if text != "auto" and not (text.isdigit() and int(text) > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is neither a positive number nor 'auto'")
    return text


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("-n", "--namespace", help="the namespace (default: the context's namespace)")
    g.add_argument("--context", help="the kubeconfig context to use (default: the current context)")
    g.add_argument("--kubeconfig", help="path to the kubeconfig file (default: $KUBECONFIG, then ~/.kube/config)")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="kubectl ddp", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run, watch, read the logs of and plot DDPJobs (PyTorch DistributedDataParallel on "
                    "Kubernetes).", epilog=EXAMPLES)
    sub = root.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, summary: str, usage: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=summary, description=summary, usage=f"kubectl ddp {usage}")
        _common(p)
        return p

    p = command("run", "Run a training script on N nodes as a DDPJob and follow it until it ends.",
                "run SCRIPT [options] [-- SCRIPT_ARGS...]")
    p.add_argument("script", help="a .py file, or a directory (with --entry) of at most ~1 MiB; with --in-image, "
                                  "the script's path inside the image")
    p.add_argument("--nodes", type=_count(1), default=1, metavar="N", help="pods (machines) to train on (default 1)")
    p.add_argument("--nproc-per-node", type=_nproc, default="1", metavar="N|auto",
                   help="workers per pod: a number, or 'auto' (one per GPU, else per CPU) (default 1)")
    p.add_argument("--spares", type=_count(0), default=0, metavar="K",
                   help="hot spare pods that take a failed pod's place (default 0)")
    p.add_argument("--image", default=DEFAULT_IMAGE, help=f"the trainer image (default {DEFAULT_IMAGE})")
    p.add_argument("--in-image", action="store_true", help="the code is baked into --image: upload nothing, run "
                   "SCRIPT from the image's working directory")
    p.add_argument("--entry", help="with a directory: the script in it to run, e.g. train.py")
    p.add_argument("--checkpoint", metavar="SIZE", help="a checkpoint volume of SIZE (e.g. 10Gi): a "
                   "ReadWriteMany PersistentVolumeClaim <job>-checkpoint, deleted with the job")
    p.add_argument("--storage-class", help="the checkpoint claim's StorageClass (default: the cluster's default)")
    p.add_argument("--cpu", default="500m", help="CPU request per pod (default 500m)")
    p.add_argument("--memory", default="1Gi", help="memory request per pod (default 1Gi)")
    p.add_argument("--memory-limit", help="memory limit per pod (default: none; a namespace's LimitRange may set one)")
    p.add_argument("--progress-period", type=int, default=5, metavar="SECONDS",
                   help="how often the operator copies rank 0's progress into status (default 5)")
    p.add_argument("--backoff-limit", type=int, metavar="N", help="restarts allowed before the job fails "
                   "(failurePolicy.backoffLimit; default: the operator's, 6)")
    p.add_argument("--max-restarts", type=int, metavar="N", help="torchrun's in-pod worker restarts before the pod "
                   "fails (torchrun.maxRestarts; default: the operator's, 10)")
    p.add_argument("--name", help="the DDPJob's name (default: the script's name and a random suffix)")
    p.add_argument("-d", "--detach", action="store_true", help="create the job and return")

    p = command("top", "Show jobs (phase, nodes, step, loss, samples/s, goodput, restarts), or one job's pods, "
                       "attempts and last recovery, refreshed until Ctrl-C.", "top [JOB] [options]")
    p.add_argument("job", nargs="?", help="one job to show in detail")
    p.add_argument("-A", "--all-namespaces", action="store_true", help="jobs of every namespace")
    p.add_argument("--once", action="store_true", help="print one screen and exit")
    p.add_argument("--interval", type=float, default=2.0, metavar="SECONDS", help="refresh period (default 2)")
    p.add_argument("-o", "--output", choices=("json", "yaml"), help="print the rows as JSON or YAML, once")

    p = command("logs", "Print the logs of every pod of a job merged in time order, each line prefixed with its "
                        "rank and pod; -f follows pods that are replaced or restarted in place.",
                "logs JOB [-f] [--rank R | --all] [--previous] [options]")
    p.add_argument("job")
    p.add_argument("-f", "--follow", action="store_true", help="keep streaming until the job's pods end")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, help="only the pod of this rank (node index)")
    which.add_argument("--all", action="store_true", help="every rank (the default)")
    p.add_argument("-p", "--previous", action="store_true", help="the previous container of each pod (after an "
                                                                  "in-place restart)")
    p.add_argument("--tail", type=int, help="lines of each pod's log to show (default: all)")

    p = command("describe", "Show one screen of a job: spec, phase and conditions, pods, attempts with their "
                            "faults, the last recovery, and events.", "describe JOB [options]")
    p.add_argument("job")

    p = command("plot", "Plot the loss (and every reported metric) against step for the whole run so far.",
                "plot JOB [-o loss.png] [--metric NAME] [options]")
    p.add_argument("job")
    p.add_argument("-o", "--output", metavar="FILE.png", help="write a PNG (default: a chart in the terminal)")
    p.add_argument("--metric", action="append", help="series to draw (default: all; in the terminal: loss)")
    return root


def _plot(kube: Any, args: argparse.Namespace, console: Any) -> int:
    from ddp_operator import history, names
    from kubectl_ddp import plot
    job = kube.job(args.job)
    points, _ = history.from_configmap(kube.config_map(names.history_configmap(args.job)))
    points = history.series(points, (job.get("status") or {}).get("progress"))
    try:
        if args.output:
            drawn = plot.write_png(points, args.output, title=f"{kube.namespace}/{args.job}", names=args.metric)
            console.print(f"wrote {args.output}: {', '.join(drawn)} over {len(points)} points")
        else:
            metric = (args.metric or ["loss"])[0]
            console.print(plot.terminal_chart(points, name=metric, width=min(console.width, 120),
                                              height=max(10, min(console.height - 4, 24)),
                                              color=console.is_terminal),
                          markup=False, highlight=False)
            for line in plot.summary_lines(points):
                console.print(line, markup=False, highlight=False)
    except ValueError as e:
        raise CliError(str(e)) from None
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    script_args: list[str] = []
    if "--" in argv:  # everything after the first -- is the script's, never ours
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    args = parser().parse_args(argv)
    args.args = script_args
    return args


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    console = Console(highlight=False)
    if not console.is_terminal:  # piped or redirected: whole lines, as kubectl prints them
        console = Console(highlight=False, soft_wrap=True, width=max(console.width, 200))
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    kube = None
    try:
        if args.command == "run" and not args.in_image and not Path(args.script).exists():
            raise CliError(f"{args.script}: no such file or directory")
        kube = connect(args.kubeconfig, args.context, args.namespace)
        if args.command == "run":
            from kubectl_ddp import run
            name = run.submit(kube, args)
            console.print(f"ddpjob.ddp.dev/{name} created")
            return 0 if args.detach else run.follow(kube, name, console)
        if args.command == "top":
            from kubectl_ddp import top
            return top.top(kube, args, console)
        if args.command == "logs":
            from kubectl_ddp import logs
            kube.job(args.job)  # an unknown job is kubectl's NotFound, not "no pods"
            return logs.show_logs(kube.core, kube.namespace, args.job, follow=args.follow, rank=args.rank,
                                  previous=args.previous, out=sys.stdout, tail=args.tail)
        if args.command == "describe":
            from kubectl_ddp import describe
            return describe.describe(kube, args, console)
        return _plot(kube, args, console)
    except CliError as e:
        err.print(f"error: {e}", markup=False)
        return 1
    except ApiException as e:  # a read no command words itself (logs' listings): the server's own sentence
        err.print(f"error: {server_error(e, f'{e.status} {e.reason}')}", markup=False)
        return 1
    except urllib3.exceptions.HTTPError as e:  # the request never reached the API server
        err.print(f"error: {unreachable(e, kube.api.configuration.host if kube else '')}", markup=False)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
