"""A local multi-node launcher for tests and benchmarks: torchrun agents as simulated pods.

Each node is one torchrun agent with its own loopback address (127.0.0.<n>, its rendezvous identity),
its own snapshot directory (its pod's /dev/shm) and its own log file. Where possible the agent runs in
its own PID namespace (``unshare --pid --fork --kill-child``), so :meth:`LocalCluster.kill` takes down
the agent and every worker at once, as a dying pod does; elsewhere the process tree is killed.
Nothing here sleeps for a fixed time: waits poll the logs for events until a deadline.
"""

from __future__ import annotations

import calendar
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from . import env as envmod
from .log import parse_line
from .testing_processes import descendants, free_port, local_rank, pidns_available

REPO_TRAINER_DIR = str(Path(__file__).resolve().parent.parent)
# The store the <job>-rdzv pod runs (store/ddp_store, beside trainer/ in the repository).
REPO_STORE_DIR = str(Path(REPO_TRAINER_DIR).parent / "store")


def parse_stamp(stamp: str) -> float:
    """Seconds since the epoch of a log timestamp like 2025-01-01T12:00:00.123Z."""
    main, _, frac = stamp.rstrip("Z").partition(".")
    return calendar.timegm(time.strptime(main, "%Y-%m-%dT%H:%M:%S")) + (int(frac) / 1000 if frac else 0.0)


@dataclass
class Node:
    name: str
    addr: str
    proc: subprocess.Popen
    log_path: Path
    snapshot_dir: Path
    started: float
    killed_at: float | None = None
    kind: str = "trainer"

    def alive(self) -> bool:
        return self.proc.poll() is None


def torchrun_workers(node: Node) -> list[int]:
    """The node's torchrun workers (their environment has LOCAL_RANK; the agent's does not)."""
    return [pid for pid in descendants(node.proc.pid) if local_rank(pid) is not None]


@dataclass
class Event:
    node: str
    time: float
    fields: dict[str, str]
    seq: int = 0

    def __getitem__(self, key: str) -> str:
        return self.fields[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    @property
    def name(self) -> str:
        return self.fields.get("event", "")

    def int(self, key: str) -> int:
        return int(self.fields[key])


class ClusterTimeout(AssertionError):
    pass


@dataclass
class LocalCluster:
    """Simulated multi-node torchrun job on loopback. Use as a context manager (kills leftovers)."""

    workdir: Path
    nnodes: str = "2:2"
    nproc_per_node: int = 1
    module: str = "ddp_trainer.examples.digits"
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    rdzv_id: str = "job"
    rdzv_port: int = 0
    #: our recommended setup: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and short keep-alives; False = stock
    fault_tolerant: bool = True
    rdzv_conf: Mapping[str, str] = field(default_factory=dict)
    max_restarts: int = 100
    #: a dedicated TCPStore process hosts the rendezvous (the operator's design); all nodes is_host=0
    store_process: bool = False
    #: its program: "ddp_store" (what the <job>-rdzv pod runs: store/ddp_store) or "torch" (torch's own TCPStore)
    store_program: str = "ddp_store"
    #: torchrun's --rdzv-backend: c10d, or ddpjob-c10d (ddp_trainer.rendezvous: hot spares never livelock)
    rdzv_backend: str = "c10d"
    python: str = sys.executable
    #: the agent: torchrun itself, or "ddp_trainer.launch" (torchrun with workers forked from a warm forkserver)
    launcher: str = "torch.distributed.run"
    #: each agent in a PID namespace of its own where the host allows (its processes die with it); False for CUDA
    #: jobs: CUDA's initialisation fails inside one (error 304, seen on a Firecracker GPU VM)
    pid_namespace: bool = True
    nodes: list[Node] = field(default_factory=list)
    store: Node | None = None
    _next_addr: int = 1
    _rdzv_backend: Any = None  # rendezvous_state's reader, made on first use

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not self.rdzv_port:
            self.rdzv_port = free_port()
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        self.shm_root = shm / f"ddpjob-test-{uuid.uuid4().hex[:10]}"

    # -- processes -------------------------------------------------------------------------------------------
    def _spawn(self, argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
        if self.pid_namespace and pidns_available():
            argv = ["unshare", "--pid", "--fork", "--kill-child", "--", *argv]
        log = open(log_path, "ab")
        try:
            return subprocess.Popen(
                argv,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()

    def base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        for k in [k for k in env if k.startswith(("PET_", "DDPJOB_", "DIGITS_"))]:
            env.pop(k)
        env.update(
            {
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [REPO_TRAINER_DIR, os.environ.get("PYTHONPATH")])),
                envmod.RUN_KEY: f"test/{self.rdzv_id}",
                envmod.PROGRESS_PORT: "0",
            }
        )
        if self.fault_tolerant:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        env.update(self.env)
        return env

    def start_store(self) -> Node:
        """Start the dedicated rendezvous store on the rendezvous port: the <job>-rdzv pod's program (store_program
        "ddp_store"), or a bare torch TCPStore ("torch")."""
        log_path = self.workdir / "store.log"
        env = self.base_env()
        if self.store_program == "ddp_store":
            argv = [self.python, "-m", "ddp_store", "--host", "127.0.0.1", "--port", str(self.rdzv_port)]
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_STORE_DIR, env.get("PYTHONPATH")]))
            ready = "event=listening"
        else:
            code = (
                "import signal, sys, torch.distributed as d\n"
                "s = d.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, wait_for_workers=False,"
                " multi_tenant=True)\n"
                "print('store ready', flush=True)\n"
                "signal.pause()\n"
            )
            argv, ready = [self.python, "-c", code, str(self.rdzv_port)], "store ready"
        proc = self._spawn(argv, env, log_path)
        self.store = Node("store", "127.0.0.1", proc, log_path, self.workdir, time.time(), kind="store")
        self.wait_for_text(self.store, ready, timeout=60)
        return self.store

    def start_node(
        self,
        name: str | None = None,
        *,
        is_host: bool | None = None,
        snapshot_dir: Path | None = None,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] | None = None,
        rdzv_id: str | None = None,
        max_restarts: int | None = None,
    ) -> Node:
        """Start one agent. ``is_host`` defaults to: the first node hosts unless a store process runs;
        ``max_restarts`` to the cluster's."""
        index = len(self.nodes)
        name = name or f"node{index}"
        addr = f"127.0.0.{self._next_addr}"
        self._next_addr += 1
        if is_host is None:
            is_host = index == 0 and not self.store_process
        conf: dict[str, str] = {"is_host": "1" if is_host else "0"}
        if self.fault_tolerant:
            conf.update({"keep_alive_interval": "1", "keep_alive_max_attempt": "2", "join_timeout": "120"})
        conf.update(self.rdzv_conf)
        snapshot_dir = snapshot_dir or (self.shm_root / name)
        node_env = self.base_env()
        node_env[envmod.SNAPSHOT_DIR] = str(snapshot_dir)
        node_env.update(env or {})
        argv = [
            self.python,
            "-m",
            self.launcher,
            f"--nnodes={self.nnodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--rdzv-backend={self.rdzv_backend}",
            f"--rdzv-endpoint=127.0.0.1:{self.rdzv_port}",
            f"--rdzv-id={rdzv_id or self.rdzv_id}",
            "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()),
            f"--local-addr={addr}",
            f"--max-restarts={self.max_restarts if max_restarts is None else max_restarts}",
            "--monitor-interval=0.2",
        ]
        if self.module.endswith(".py"):
            argv.append(self.module)
        else:
            argv += ["-m", self.module]
        argv += list(self.args if args is None else args)
        log_path = self.workdir / f"{name}.log"
        node = Node(name, addr, self._spawn(argv, node_env, log_path), log_path, snapshot_dir, time.time())
        self.nodes.append(node)
        return node

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def kill_workers(self, node: Node, local_ranks: Iterable[int] | None = None) -> float:
        """SIGKILL the node's torchrun workers (those of ``local_ranks``; default all), not its agent (which restarts
        all of them in place). Returns the kill time."""
        wanted = None if local_ranks is None else set(local_ranks)
        pids = [pid for pid in torchrun_workers(node) if wanted is None or local_rank(pid) in wanted]
        assert pids, self.dump()
        killed_at = time.time()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return killed_at

    def kill(self, node: Node, sig: int = signal.SIGKILL) -> float:
        """Kill a node; SIGKILL takes the agent and all its workers at once. Returns the kill time."""
        if sig == signal.SIGKILL:
            victims = descendants(node.proc.pid)
            node.killed_at = time.time()
            for pid in [node.proc.pid, *victims]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        else:
            # A graceful stop (kubelet deleting a pod): the signal goes to the container's PID 1, torchrun.
            node.killed_at = time.time()
            target = node.proc.pid
            if pidns_available():
                kids = [p for p in descendants(node.proc.pid)]
                target = kids[0] if kids else node.proc.pid
            os.kill(target, sig)
        return node.killed_at

    def wait_exit(self, nodes: Iterable[Node] | None = None, timeout: float = 300) -> dict[str, int]:
        nodes = list(self.nodes if nodes is None else nodes)
        deadline = time.time() + timeout
        out = {}
        for n in nodes:
            try:
                out[n.name] = n.proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                raise ClusterTimeout(f"{n.name} still running after {timeout}s\n{self.dump()}") from None
        return out

    def close(self) -> None:
        for n in [*self.nodes, *([self.store] if self.store else [])]:
            if n.alive():
                self.kill(n)
            try:
                n.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.shm_root, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the rendezvous ---------------------------------------------------------------------------------------
    def rendezvous_state(self) -> Any | None:
        """torch's rendezvous state as the agents share it in the store (None before the first agent wrote it),
        read the way an agent reads it (torch's c10d backend over a store client of its own)."""
        import pickle

        from torch.distributed import TCPStore
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

        if self._rdzv_backend is None:
            store = TCPStore("127.0.0.1", self.rdzv_port, is_master=False, timeout=timedelta(seconds=30))
            self._rdzv_backend = C10dRendezvousBackend(store, self.rdzv_id)
        got = self._rdzv_backend.get_state()
        return None if got is None else pickle.loads(got[0])

    def wait_for_rendezvous(self, predicate: Callable[[Any], bool], *, timeout: float, what: str) -> Any:
        """Poll the rendezvous state until ``predicate`` holds for it; returns that state."""
        deadline = time.time() + timeout
        while True:
            state = self.rendezvous_state()
            if state is not None and predicate(state):
                return state
            if time.time() > deadline:
                raise ClusterTimeout(f"timed out after {timeout}s waiting for the rendezvous: {what}\n{self.dump()}")
            time.sleep(0.05)

    # -- logs ------------------------------------------------------------------------------------------------
    def events(self, name: str | None = None) -> list[Event]:
        """Every structured ddp_trainer line of every node, in log-time order."""
        out: list[Event] = []
        seq = 0
        for n in self.nodes:
            try:
                text = n.log_path.read_text(errors="replace")
            except OSError:
                continue
            for line in text.splitlines():
                fields = parse_line(line)
                if not fields or "event" not in fields:
                    continue
                if name is not None and fields["event"] != name:
                    continue
                stamp = line.split(" ", 1)[0]
                try:
                    t = parse_stamp(stamp)
                except ValueError:
                    continue
                seq += 1
                out.append(Event(n.name, t, fields, seq))
        out.sort(key=lambda e: (e.time, e.seq))
        return out

    def wait_for(
        self, predicate: Callable[[Event], bool], *, timeout: float, what: str, name: str | None = None
    ) -> Event:
        deadline = time.time() + timeout
        while True:
            for e in self.events(name):
                if predicate(e):
                    return e
            if time.time() > deadline:
                raise ClusterTimeout(f"timed out after {timeout}s waiting for {what}\n{self.dump()}")
            if all(not n.alive() for n in self.nodes):
                # one last look: the event may have been written just before exit
                for e in self.events(name):
                    if predicate(e):
                        return e
                raise ClusterTimeout(f"all nodes exited while waiting for {what}\n{self.dump()}")
            time.sleep(0.1)

    def wait_for_step(self, step: int, *, timeout: float, after: float = 0.0, rank: int | None = None) -> Event:
        """The first step line at or past ``step`` (every node logs them; ``rank`` picks one rank's)."""
        return self.wait_for(
            lambda e: e.int("step") >= step and e.time >= after and (rank is None or e.get("rank") == str(rank)),
            timeout=timeout,
            what=f"step {step}",
            name="step",
        )

    def wait_for_text(self, node: Node, text: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while text not in node.log_path.read_text(errors="replace"):
            if time.time() > deadline or not node.alive():
                raise ClusterTimeout(f"{node.name}: no {text!r} after {timeout}s\n{self.dump()}")
            time.sleep(0.1)

    def dump(self, lines: int = 40) -> str:
        parts = []
        for n in [*self.nodes, *([self.store] if self.store else [])]:
            try:
                tail = n.log_path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                tail = []
            state = "running" if n.alive() else f"exit {n.proc.returncode}"
            parts.append(f"----- {n.name} ({state}) {n.log_path}\n" + "\n".join(tail))
        return "\n".join(parts)
