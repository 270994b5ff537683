#!/usr/bin/env python3
"""A local OCI registry for releases and their test: CNCF Distribution's registry on 127.0.0.1, its blobs on disk,
and the embedded cluster's containerd told to pull from it over plain HTTP.

    hack/registry.py up               start it (a free port; a no-op when it runs) and print its address
    hack/registry.py url              print its address; exit 1 when it is not running
    hack/registry.py down [--purge]   stop it; --purge also forgets what it stored

Built by `hack/build-binaries.sh registry`. Its state (pid, port) is $DDPJOB_CACHE/registry/state.json, its storage
$DDPJOB_CACHE/registry/data and its log $DDPJOB_CACHE/registry/registry.log. The storage outlives `down`, as a real
registry's would: a release pushes only the blobs the registry lacks, so the multi-GB trainer layer travels once per
machine, and the next `up` takes the same port where it is free, so earlier releases' references stay good.

containerd reads <host:port>/hosts.toml under REGISTRY_HOSTS_DIR (the `config_path` of its CRI registry config,
hack/common.py) at each pull, so `up` needs no restart of it; a containerd started with a config from before
`config_path` was set reaches a loopback registry over plain HTTP anyway (its default for localhost and 127.0.0.1).
A kind cluster's nodes cannot reach the host's loopback: releases for kind go to a registry they can reach.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

if not __package__:  # run as a script (python hack/registry.py): hack.* from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hack import common  # noqa: E402
from hack.common import ClusterError  # noqa: E402

HOME = common.CACHE / "registry"
STATE = HOME / "state.json"
DATA = HOME / "data"
LOG = HOME / "registry.log"
CONFIG = HOME / "config.yml"
HOST = "127.0.0.1"
START_TIMEOUT = 20.0

log = common.logger("registry")


def config_text(port: int, data: Path, secret: str) -> str:
    """The registry's configuration: loopback only, filesystem storage, quiet logs, no telemetry."""
    return "\n".join([
        "version: 0.1",
        "log:",
        "  level: warn",
        "  accesslog:",
        "    disabled: true",
        "storage:",
        "  filesystem:",
        f"    rootdirectory: {data}",
        "  cache:",
        "    blobdescriptor: inmemory",
        "  delete:",  # a test deletes the releases it made; `up` then collects their blobs (collect_garbage)
        "    enabled: true",
        "http:",
        f"  addr: {HOST}:{port}",
        f"  secret: {secret}",  # one instance: a fixed secret only silences the warning about a generated one
        "",
    ])


def hosts_toml(address: str) -> str:
    """containerd's hosts.toml for the registry at `address` (host:port): plain HTTP, pull and resolve."""
    return (f'# hack/registry.py: the local release registry, plain HTTP on the loopback interface\n'
            f'server = "http://{address}"\n\n'
            f'[host."http://{address}"]\n'
            f'  capabilities = ["pull", "resolve"]\n')


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/v2/", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(cmdline) and os.path.basename(cmdline[0]) == b"registry"


def running() -> dict | None:
    """The state of the registry this file started, when it still runs and answers; else None."""
    try:
        state = json.loads(STATE.read_text())
    except (OSError, ValueError):
        return None
    if _alive(state.get("pid", 0)) and _answers(state.get("port", 0)):
        return state
    return None


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the registry's listener (Go) does: TIME_WAIT
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _pick_port(previous: int | None) -> int:
    if previous and _free(previous):
        return previous
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def write_hosts(address: str) -> Path:
    path = common.REGISTRY_HOSTS_DIR / address / "hosts.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(hosts_toml(address))
    return path


def up() -> str:
    """Start the registry unless it runs; its address (host:port)."""
    HOME.mkdir(parents=True, exist_ok=True)
    with open(HOME / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # `make release` and its test may both call up
        state = running()
        if state is None:
            try:
                previous = json.loads(STATE.read_text()).get("port")
            except (OSError, ValueError):
                previous = None
            state = _start(_pick_port(previous))
        address = f"{HOST}:{state['port']}"
        write_hosts(address)  # again each time: `hack/cluster.py down` may have removed the cluster's config
        return address


ENV = {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"}


def collect_garbage(binary: str) -> None:
    """Remove the blobs no tag reaches any more (deleted releases: a multi-GB trainer layer each), while the registry
    is stopped, as Distribution requires. Seconds; run by every start."""
    p = subprocess.run([binary, "garbage-collect", "--delete-untagged", str(CONFIG)], capture_output=True, text=True,
                       env={**os.environ, **ENV}, timeout=600)
    if p.returncode != 0:
        log(f"(ignored) garbage-collect failed: {p.stderr.strip()[-500:]}")


def _start(port: int) -> dict:
    binary = common.binary("registry")
    DATA.mkdir(parents=True, exist_ok=True)
    CONFIG.write_text(config_text(port, DATA, secrets.token_hex(16)))
    collect_garbage(binary)
    env = {**os.environ, **ENV}
    with open(LOG, "wb") as out:  # this run's log only (its 404s, the answers to existence checks, are logged)
        proc = subprocess.Popen([binary, "serve", str(CONFIG)], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT
    while not _answers(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            tail = LOG.read_text(errors="replace")[-2000:]
            raise ClusterError(f"the registry did not answer on {HOST}:{port} (log {LOG}):\n{tail}")
        time.sleep(0.1)
    state = {"pid": proc.pid, "port": port, "data": str(DATA), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                       time.gmtime())}
    STATE.write_text(json.dumps(state))
    log(f"registry at {HOST}:{port} (pid {proc.pid}, storage {DATA})")
    return state


def url() -> str | None:
    state = running()
    return f"{HOST}:{state['port']}" if state else None


def down(purge: bool = False) -> None:
    state = running()
    if state is not None:
        os.kill(state["pid"], signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _alive(state["pid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(state["pid"]):
            os.kill(state["pid"], signal.SIGKILL)
        shutil.rmtree(common.REGISTRY_HOSTS_DIR / f"{HOST}:{state['port']}", ignore_errors=True)
        log(f"stopped the registry at {HOST}:{state['port']}")
    if purge:
        shutil.rmtree(HOME, ignore_errors=True)
        log(f"removed {HOME}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hack/registry.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="start the registry (a no-op when it runs); prints host:port")
    sub.add_parser("url", help="print host:port; exit 1 when it is not running")
    d = sub.add_parser("down", help="stop the registry")
    d.add_argument("--purge", action="store_true", help="also remove its storage")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            print(up())
        elif args.command == "url":
            address = url()
            if address is None:
                print("the registry is not running: hack/registry.py up", file=sys.stderr)
                return 1
            print(address)
        else:
            down(args.purge)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
