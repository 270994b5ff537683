#!/usr/bin/env python3
"""`make bench-rdzv-scale`: the c10d rendezvous with 8 to 512 agents against one real TCPStore, torch's own handler
and this project's ``ddpjob-c10d`` (ddp_trainer.rendezvous), on loopback, without training workers.

    .venv/bin/python tests/benchmarks/rdzv_scale.py [--agents 8,32,128,512] [--procs 2] [--store ddp_store|torch]
        [--quick] [--record]

The store is the ``<job>-rdzv`` pod's own program (store/ddp_store, the store image's entrypoint) run in a subprocess,
bound to 127.0.0.1 on a free port; ``--store torch`` runs torch's own TCPStore server instead (what the pod ran before
it had an image of its own), for comparison (docs/scale.md). An agent is a real rendezvous handler with its own TCPStore client, made as torchrun makes
it: torch's ``c10d`` handler (``create_backend`` + ``dynamic_rendezvous.create_handler``) or ours
(``ddp_trainer.rendezvous.create_handler``, the ``torchrun.handlers`` entry point), ``is_host=0`` and
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` as the operator sets them, keep-alives 1 s x 3 (the operator's defaults), and
for ours the join loop's 0.1 s turn of ``ddp_trainer.launch``. The agents live as threads in ``--procs`` worker
processes (the GIL: one process of 512 agents measures Python, not the rendezvous; every agent's CPU is in the JSON
as ``agents_cpu_s`` next to the wall time so a reader sees when the machine, not the protocol, was the limit, and
of it ``agents_gc_s``, the garbage collector's: a worker's one heap holds hundreds of agents' states, which a real
agent, alone in its process, does not carry. ``--agent-gc`` paces each worker's collector per agent, as if each had
its own process; its record is kept beside the default one).

Each run forms one group of N (``form``: every agent returned from its first ``next_rendezvous()``), lets it train
(``idle``: heartbeats only), then loses one member without leaving (its keep-alive timer stopped, as a SIGKILLed
agent's: it stays a participant until its heartbeats expire) while every survivor asks for the next round at once,
as torchrun does when its workers fail. ``reform``: from the loss to every member of the new round holding its rank.
Runs (handler:scenario):

- ``c10d:replace`` — torch's handler; the recreated pod's agent (a new identity) joins at once, and the round waits
  for the lost agent's heartbeats to expire (a DDPJob without spares on stock torchrun);
- ``ddpjob-c10d:replace`` — ours, the same, with rule 4 off (``DDPJOB_TAKE_OVER=0``);
- ``ddpjob-c10d:take_over`` — ours, the new agent has the lost one's ``DDPJOB_POD_INDEX`` (rule 4): no waiting;
- ``ddpjob-c10d:spare`` — ours, N+1 agents (``--nnodes=N:N``): no replacement, the spare takes the place once the
  lost agent's heartbeats expired.

Counted per phase: store operations by kind through a counting proxy around every agent's client (get, set,
compare_set, add, check, wait, multi_get, ...) and compare_set calls that lost the race (``cas_lost``), the store
server's CPU seconds (/proc/<pid>/stat) and its peak resident memory (VmHWM), the state's size in bytes (the pickled state torch writes, read back at the
end of the phase), and for ``ddpjob-c10d`` the state writes that took (``state_writes``: its version key's
growth, rule 11). ``slopes`` gives d log(y) / d log(N) between the two largest N: 1 is linear, 2 quadratic.

Outcomes judged (``goals_missed``): every member of a round got a rank, ranks 0..N-1 each exactly once, all in one
round, no survivor left behind, the newcomer (replacement or spare) in the re-formed round, the spare not given a
rank while the group was full, a key for every N. Times are recorded, never judged.
"""

from __future__ import annotations

import argparse
import base64
import gc
import math
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT, ROOT / "operator", ROOT / "trainer"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
from tests.benchmarks import results  # noqa: E402

FULL_AGENTS = [8, 32, 128, 512]
QUICK_AGENTS = [8, 32]
RUNS = ["c10d:replace", "ddpjob-c10d:replace", "ddpjob-c10d:take_over", "ddpjob-c10d:spare"]
QUICK_RUNS = ["c10d:replace", "ddpjob-c10d:take_over", "ddpjob-c10d:spare"]
KEEP_ALIVE_S, KEEP_ALIVE_ATTEMPTS = 1, 3  # the operator's defaults (crd.DEFAULTS)
LAUNCH_POLL_S = 0.1  # ddp_trainer.launch's join-loop turn (DDPJOB_RDZV_POLL_SECONDS' default)
FIGURES = ("form_s", "reform_s", "ops_per_agent_form", "ops_per_agent_reform", "bytes_per_agent_reform",
           "store_cpu_s_reform", "state_bytes", "cas_lost_per_agent_reform", "state_writes_reform",
           "idle_ops_per_agent_per_s", "idle_bytes_per_agent_per_s", "idle_store_cpu_s_per_s")


# --- the store ----------------------------------------------------------------------------------------------------

STORES = ("ddp_store", "torch")
# torch's own server, as the rdzv pod ran it in the trainer image before store/ddp_store: the comparison.
TORCH_STORE = """\
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
from torch.distributed import TCPStore
port = int(os.environ["DDPJOB_RDZV_PORT"])
store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
print(f"rendezvous store listening on :{port}", flush=True)
while True:
    time.sleep(3600)
"""


def store_command(port: int, program: str = "ddp_store") -> tuple[list[str], dict[str, str]]:
    """The store's command and environment, bound to loopback: the rdzv pod's program (the store image's entrypoint,
    `python -m ddp_store`, reading its port from DDPJOB_RDZV_PORT as in the pod), or torch's own server."""
    from ddp_operator import names

    env = {**os.environ, names.ENV_RDZV_PORT: str(port), "PYTHONUNBUFFERED": "1"}
    if program == "torch":
        return [sys.executable, "-c", TORCH_STORE], env
    if program != "ddp_store":
        raise ValueError(f"store program {program!r}: one of {STORES}")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "store"), env.get("PYTHONPATH")]))
    return [sys.executable, "-m", "ddp_store", "--host", "127.0.0.1"], env


def cpu_seconds(pid: int | str = "self") -> float:
    """utime + stime of a process, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- the agents (in worker processes) -----------------------------------------------------------------------------

def _counting_store_class():
    import torch.distributed as dist

    class Counting(dist.Store):
        """A store client that counts its operations (and compare_sets that lost the race)."""

        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner, self.ops, self.cas_lost, self.bytes = inner, {}, 0, 0

        def _n(self, op: str, *sizes: Any) -> None:
            """Count the operation and the bytes of keys and values it moved either way."""
            self.ops[op] = self.ops.get(op, 0) + 1
            self.bytes += sum(len(x) for x in sizes)

        def set(self, k, v):
            self._n("set", k, v)
            return self.inner.set(k, v)

        def get(self, k):
            out = self.inner.get(k)
            self._n("get", k, out)
            return out

        def compare_set(self, k, expected, desired):
            out = self.inner.compare_set(k, expected, desired)
            self._n("compare_set", k, expected, desired, out)
            if expected not in ("", b"") and out != (desired.encode() if isinstance(desired, str) else desired):
                self.cas_lost += 1
            return out

        def add(self, k, n):
            self._n("add")
            return self.inner.add(k, n)

        def check(self, keys):
            self._n("check", *keys)
            return self.inner.check(keys)

        def wait(self, keys, *timeout):
            self._n("wait", *keys)
            return self.inner.wait(keys, *timeout)

        def multi_get(self, keys):
            out = self.inner.multi_get(keys)
            self._n("multi_get", *keys, *out)
            return out

        def multi_set(self, keys, values):
            self._n("multi_set")
            return self.inner.multi_set(keys, values)

        def append(self, k, v):
            self._n("append")
            return self.inner.append(k, v)

        def delete_key(self, k):
            self._n("delete_key")
            return self.inner.delete_key(k)

        def num_keys(self):
            self._n("num_keys")
            return self.inner.num_keys()

        def set_timeout(self, timeout):
            return self.inner.set_timeout(timeout)

    return Counting


class _GcClock:
    """Seconds this process spent in Python's garbage collector (gc.callbacks), and, with ``per_agent``, its thresholds
    scaled to the agents living here: a worker holds hundreds of agents' states in one heap, where each real agent has a
    process of its own, so its young generation fills hundreds of times faster and each full collection walks every
    agent's objects (docs/scale.md). Scaled, a young collection comes once per 700 allocations of each agent, as it
    would in its own process."""

    def __init__(self, per_agent: bool) -> None:
        self.per_agent, self.seconds, self._started = per_agent, 0.0, 0.0
        self._default = gc.get_threshold()
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, _info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started

    def agents(self, n: int) -> None:
        if self.per_agent:
            gc.set_threshold(self._default[0] * max(1, n), *self._default[1:])


class _Worker:
    """The agents of one worker process, driven by the orchestrator's commands."""

    def __init__(self, agent_gc: bool = False) -> None:
        from datetime import timedelta

        from torch.distributed import TCPStore
        from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
        from torch.distributed.elastic.rendezvous import utils

        counting = _counting_store_class()
        self.stores: list[Any] = []

        def tcp_store(params: Any) -> Any:  # c10d's own client, counted
            host, port = params.endpoint.rsplit(":", 1)
            store = counting(TCPStore(host, int(port), is_master=False, multi_tenant=True,
                                      timeout=timedelta(seconds=int(params.get("read_timeout", "60")))))
            self.stores.append(store)
            return store

        c10d._create_tcp_store = tcp_store
        self.poll: float | None = None  # ddp_trainer.launch's join-loop turn, for our backend's runs

        def delay(seconds: Any) -> None:
            if self.poll is not None and isinstance(seconds, (int, float)):
                seconds = min(seconds, self.poll)
            utils._delay(seconds)

        dr._delay = delay
        self.agents: dict[int, dict[str, Any]] = {}
        self.gc = _GcClock(agent_gc)

    def make(self, port: int, run_id: str, backend: str, nodes: tuple[int, int], specs: list[tuple[int, str | None]],
             take_over: bool, keep_alive_s: int = KEEP_ALIVE_S) -> None:
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

        from ddp_trainer import env as envmod
        from ddp_trainer import rendezvous

        self.poll = None if backend == "c10d" else LAUNCH_POLL_S
        for aid, pod in specs:
            params = RendezvousParameters(
                backend=backend, endpoint=f"127.0.0.1:{port}", run_id=run_id, min_nodes=nodes[0],
                max_nodes=nodes[1], local_addr=f"agent-{aid}", is_host="0", join_timeout="600",
                last_call_timeout="10", keep_alive_interval=str(keep_alive_s),
                keep_alive_max_attempt=str(KEEP_ALIVE_ATTEMPTS))
            before = len(self.stores)
            if backend == "c10d":
                handler = dr.create_handler(*reversed(c10d.create_backend(params)), params)
            else:  # the environment the operator gives a pod, read once by create_handler
                os.environ[envmod.TAKE_OVER] = "1" if take_over else "0"
                os.environ.pop(envmod.POD_INDEX, None) if pod is None else os.environ.update({envmod.POD_INDEX: pod})
                handler = rendezvous.create_handler(params)
            self.agents[aid] = {"handler": handler, "store": self.stores[before], "thread": None, "result": None}
        self.gc.agents(len(self.agents))

    def join(self, ids: list[int]) -> None:
        for aid in ids:
            agent = self.agents[aid]
            agent["result"] = None
            agent["thread"] = threading.Thread(target=self._next_round, args=(agent,), daemon=True)
            agent["thread"].start()

    @staticmethod
    def _next_round(agent: dict[str, Any]) -> None:
        handler = agent["handler"]
        try:
            info = handler.next_rendezvous()
            agent["result"] = {"rank": info.rank, "world": info.world_size,
                               "round": handler._state_holder.state.round, "t": time.time()}
        except Exception as e:  # noqa: BLE001 (reported as an outcome)
            agent["result"] = {"error": f"{type(e).__name__}: {e}"[:300], "t": time.time()}

    def results(self, ids: list[int]) -> dict[int, Any]:
        return {aid: self.agents[aid]["result"] for aid in ids}

    def silence(self, aid: int) -> None:
        """A SIGKILLed agent: no heartbeat, no leaving; its client stays connected (the store does not care)."""
        self.agents[aid]["handler"]._stop_heartbeats()

    def counters(self) -> dict[str, Any]:
        ops: dict[str, int] = {}
        for store in self.stores:
            for op, n in store.ops.items():
                ops[op] = ops.get(op, 0) + n
        return {"ops": ops, "cas_lost": sum(s.cas_lost for s in self.stores), "bytes": sum(s.bytes for s in self.stores),
                "cpu_s": cpu_seconds(), "gc_s": self.gc.seconds}

    def drop(self) -> None:
        """End a run: its rendezvous closed (a spare waiting in it ends at its next read), every heartbeat stopped."""
        for i, agent in enumerate(self.agents.values()):
            agent["handler"]._stop_heartbeats()
            if i == 0:
                try:
                    agent["handler"].set_closed()
                except Exception:  # noqa: BLE001 (a run cut short: nothing to close)
                    pass
        self.agents.clear()


def _serve(conn: Any, agent_gc: bool = False) -> None:
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # as the operator sets it
    worker = _Worker(agent_gc)
    while True:
        command, args = conn.recv()
        if command == "stop":
            return
        try:
            conn.send(("ok", getattr(worker, command)(*args)))
        except Exception as e:  # noqa: BLE001
            conn.send(("error", f"{type(e).__name__}: {e}"))


class Workers:
    """``procs`` worker processes; agent ``aid`` lives in worker ``aid % procs``."""

    def __init__(self, procs: int, agent_gc: bool = False) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(procs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, agent_gc), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def of(self, aid: int) -> int:
        return aid % len(self.conns)

    def call(self, command: str, per_worker: list[tuple] | None = None, args: tuple = ()) -> list[Any]:
        for i, conn in enumerate(self.conns):
            conn.send((command, per_worker[i] if per_worker is not None else args))
        out = []
        for conn in self.conns:
            status, value = conn.recv()
            if status != "ok":
                raise RuntimeError(f"worker {command}: {value}")
            out.append(value)
        return out

    def one(self, aid: int, command: str, args: tuple) -> Any:
        """``command`` in the worker of agent ``aid`` only."""
        conn = self.conns[self.of(aid)]
        conn.send((command, args))
        status, value = conn.recv()
        if status != "ok":
            raise RuntimeError(f"worker {command}: {value}")
        return value

    def split(self, ids: list[int]) -> list[list[int]]:
        parts: list[list[int]] = [[] for _ in self.conns]
        for aid in ids:
            parts[self.of(aid)].append(aid)
        return parts

    def counters(self) -> dict[str, Any]:
        ops: dict[str, int] = {}
        total = {"cas_lost": 0, "bytes": 0, "cpu_s": 0.0, "gc_s": 0.0}
        for c in self.call("counters"):
            for op, n in c["ops"].items():
                ops[op] = ops.get(op, 0) + n
            total["cas_lost"] += c["cas_lost"]
            total["bytes"] += c["bytes"]
            total["cpu_s"] += c["cpu_s"]
            total["gc_s"] += c["gc_s"]
        return {"ops": ops, **total}

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("stop", ()))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()


# --- one run ------------------------------------------------------------------------------------------------------

def round_facts(got: dict[int, Any], members: list[int], world: int, newcomer: int | None = None) -> dict[str, Any]:
    """What a round's results say (pure): every member ranked, ranks 0..world-1 once each, one round."""
    ranked = {aid: r for aid, r in got.items() if aid in members and r and "rank" in r}
    ranks = sorted(r["rank"] for r in ranked.values())
    errors = sorted({r["error"] for r in got.values() if r and "error" in r})
    return {
        "members": len(members),
        "ranked": len(ranked),
        "left_behind": sorted(set(members) - set(ranked))[:20],
        "duplicate_ranks": len(ranks) - len(set(ranks)),
        "ranks_complete": ranks == list(range(world)),
        "worlds": sorted({r["world"] for r in ranked.values()}),
        "rounds": sorted({r["round"] for r in ranked.values()}),
        "newcomer_ranked": None if newcomer is None else newcomer in ranked,
        "errors": errors[:5],
    }


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    ops = {op: n - before["ops"].get(op, 0) for op, n in after["ops"].items() if n - before["ops"].get(op, 0)}
    return {"ops": ops, "ops_total": sum(ops.values()), "cas_lost": after["cas_lost"] - before["cas_lost"],
            "bytes": after["bytes"] - before["bytes"],
            "agents_cpu_s": round(after["cpu_s"] - before["cpu_s"], 2),
            "agents_gc_s": round(after["gc_s"] - before["gc_s"], 2)}


class Store:
    """The store program in a subprocess on a free loopback port, and a client of its own."""

    def __init__(self, program: str = "ddp_store") -> None:
        from torch.distributed import TCPStore

        from ddp_trainer.testing import free_port

        self.port = free_port()
        command, env = store_command(self.port, program)
        self.proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.proc.stdout.readline()  # its first line: listening
        self.client = TCPStore("127.0.0.1", self.port, is_master=False)

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def peak_rss_mib(self) -> float:
        """The store process's peak resident memory so far (VmHWM)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        return round(kib / 1024, 1)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def one_run(run: str, n: int, workers: Workers, store: Store, idle_s: float,
            keep_alive_s: int = KEEP_ALIVE_S) -> dict[str, Any]:
    """One group of N on the shared store (a run id of its own): formed, trained, one member lost, re-formed; closed
    at the end (a spare still waiting ends with it), its agents dropped."""
    backend, scenario = run.split(":")
    port, procs = store.port, len(workers.conns)
    run_id = f"bench-{backend}-{scenario}-{n}"
    spare = scenario == "spare"
    agents = list(range(n + (1 if spare else 0)))
    pods = scenario in ("take_over", "spare")
    try:
        specs = [[(aid, str(aid) if pods else None) for aid in part] for part in workers.split(agents)]
        workers.call("make", [(port, run_id, backend, (n, n), s, pods, keep_alive_s) for s in specs])
        timeout = 60 + n / 4 + KEEP_ALIVE_ATTEMPTS * keep_alive_s

        def state_bytes() -> int:
            return len(base64.b64decode(store.client.get(f"torch.rendezvous.{run_id}")))

        def version() -> int:  # state writes that took: ddpjob-c10d's rule 11 counts them (torch's handler does not)
            return int(store.client.add(f"torch.rendezvous.{run_id}/version", 0))

        def writes(before: int, after: int) -> int | None:
            return None if backend == "c10d" else after - before

        cpu = store.cpu
        out: dict[str, Any] = {"agents": len(agents), "nodes": n, "procs": procs}
        c0, s0, v0, t0 = workers.counters(), cpu(), version(), time.time()
        workers.call("join", [(p,) for p in workers.split(agents)])
        got = _gather(workers, agents, t0 + timeout, enough=n)
        c1, s1, v1 = workers.counters(), cpu(), version()
        # with N+1 agents for N places, whichever is left without a rank is the spare (rule 2 decides who)
        unranked = [aid for aid in agents if not (got[aid] and "rank" in got[aid])]
        training = [aid for aid in agents if aid not in unranked] if spare and len(unranked) == 1 else agents[:n]
        form = round_facts(got, training, n)
        done = [r["t"] for r in got.values() if r and "rank" in r]
        out["form"] = {**form, **_delta(c1, c0), "s": round(max(done) - t0, 3) if form["ranked"] == n else None,
                       "store_cpu_s": round(s1 - s0, 3), "state_bytes": state_bytes(), "state_writes": writes(v0, v1)}
        if spare:
            out["form"]["spares_waiting"] = len(unranked)
        if form["ranked"] != n:
            return out

        time.sleep(idle_s)  # training: heartbeats only
        c2, s2, v2 = workers.counters(), cpu(), version()
        idle = _delta(c2, c1)
        out["idle"] = {"s": idle_s, "state_writes": writes(v1, v2),
                       "ops_per_agent_per_s": round(idle["ops_total"] / len(agents) / idle_s, 2),
                       "bytes_per_agent_per_s": round(idle["bytes"] / len(agents) / idle_s),
                       "store_cpu_s_per_s": round((s2 - s1) / idle_s, 3), "ops": idle["ops"]}

        victim = next(aid for aid, r in got.items() if r and r.get("rank") == 1)
        survivors = [aid for aid in training if aid != victim]
        newcomer = unranked[0] if spare else len(agents)
        t1 = time.time()
        workers.one(victim, "silence", (victim,))
        if scenario != "spare":
            workers.one(newcomer, "make", (port, run_id, backend, (n, n), [(newcomer, str(victim) if pods else None)],
                                           pods, keep_alive_s))
        joining = survivors + ([newcomer] if scenario != "spare" else [])
        workers.call("join", [(p,) for p in workers.split(joining)])
        members = survivors + [newcomer]
        got = _gather(workers, members, t1 + timeout)
        c3, s3, v3 = workers.counters(), cpu(), version()
        reform = round_facts(got, members, n, newcomer)
        done = [r["t"] for r in got.values() if r and "rank" in r]
        out["reform"] = {**reform, **_delta(c3, c2), "s": round(max(done) - t1, 3) if reform["ranked"] == n else None,
                         "store_cpu_s": round(s3 - s2, 3), "state_bytes": state_bytes(), "state_writes": writes(v2, v3),
                         "after_form_round": bool(reform["rounds"] and form["rounds"] and reform["rounds"][0] > form["rounds"][0])}
        return out
    finally:
        workers.call("drop")


def _gather(workers: Workers, ids: list[int], deadline: float, enough: int | None = None) -> dict[int, Any]:
    """The agents' results once ``enough`` of them (all by default) returned, or at the deadline."""
    enough = len(ids) if enough is None else enough
    while True:
        got: dict[int, Any] = {}
        for part in workers.call("results", [(p,) for p in workers.split(ids)]):
            got.update(part)
        if sum(1 for r in got.values() if r is not None) >= enough or time.time() > deadline:
            return got
        time.sleep(0.05)


# --- the result ---------------------------------------------------------------------------------------------------

def figures(r: dict[str, Any]) -> dict[str, Any]:
    """The per-run figures the JSON's tables hold (None where not measured)."""
    form, reform, idle = r.get("form") or {}, r.get("reform") or {}, r.get("idle") or {}
    agents = r.get("agents") or 1
    return {
        "form_s": form.get("s"),
        "reform_s": reform.get("s"),
        "ops_per_agent_form": round(form["ops_total"] / agents, 1) if "ops_total" in form else None,
        "ops_per_agent_reform": round(reform["ops_total"] / agents, 1) if "ops_total" in reform else None,
        "bytes_per_agent_reform": round(reform["bytes"] / agents) if "bytes" in reform else None,
        "store_cpu_s_reform": reform.get("store_cpu_s"),
        "state_bytes": reform.get("state_bytes", form.get("state_bytes")),
        "cas_lost_per_agent_reform": round(reform["cas_lost"] / agents, 2) if "cas_lost" in reform else None,
        "state_writes_reform": reform.get("state_writes"),
        "idle_ops_per_agent_per_s": idle.get("ops_per_agent_per_s"),
        "idle_bytes_per_agent_per_s": idle.get("bytes_per_agent_per_s"),
        "idle_store_cpu_s_per_s": idle.get("store_cpu_s_per_s"),
    }


def summarize(runs: dict[str, dict[str, Any]], agents: list[int]) -> dict[str, Any]:
    """The by-N tables (keys: N as strings, then handler:scenario) and the slopes between the two largest N."""
    table = {f: {str(n): {run: figures(by_n[str(n)])[f] for run, by_n in runs.items() if str(n) in by_n}
                 for n in agents} for f in FIGURES}
    out = {
        "form_s_by_agents": table["form_s"],
        "reform_s_by_agents": table["reform_s"],
        "store_ops_per_agent_by_agents": table["ops_per_agent_reform"],
        "store_ops_per_agent_form_by_agents": table["ops_per_agent_form"],
        "store_bytes_per_agent_by_agents": table["bytes_per_agent_reform"],
        "training_ops_per_agent_per_s_by_agents": table["idle_ops_per_agent_per_s"],
        "training_bytes_per_agent_per_s_by_agents": table["idle_bytes_per_agent_per_s"],
        "training_store_cpu_s_per_s_by_agents": table["idle_store_cpu_s_per_s"],
        "store_cpu_s_by_agents": table["store_cpu_s_reform"],
        "state_bytes_by_agents": table["state_bytes"],
        "cas_lost_per_agent_by_agents": table["cas_lost_per_agent_reform"],
        "state_writes_reform_by_agents": table["state_writes_reform"],
    }
    if len(agents) >= 2:
        lo, hi = sorted(agents)[-2:]
        out["slopes"] = {"between": [lo, hi], **{f: {run: _slope(table[f][str(lo)].get(run), table[f][str(hi)].get(run),
                                                                   lo, hi) for run in runs} for f in FIGURES}}
    return out


def _slope(a: float | None, b: float | None, lo: int, hi: int) -> float | None:
    if not a or not b or a <= 0 or b <= 0:
        return None
    return round(math.log(b / a) / math.log(hi / lo), 2)


def goals_missed(result: dict[str, Any]) -> list[str]:
    """Outcomes, never times ([]: all held)."""
    out: list[str] = []
    for run, by_n in result["runs"].items():
        for n in result["agents"]:
            r = by_n.get(str(n))
            where = f"{run} N={n}"
            if r is None:
                out += results.goal(False, f"{where} run", None, "measured")
                continue
            for phase in ("form", "reform"):
                p = r.get(phase)
                if p is None:
                    out += results.goal(False, f"{where} {phase}", None, "reached")
                    continue
                out += results.goal(p["ranked"] == p["members"], f"{where} {phase} ranked", p["ranked"],
                                    f"every member ({p['members']}), none left behind: {p['left_behind']}")
                out += results.goal(p["duplicate_ranks"] == 0, f"{where} {phase} duplicate_ranks",
                                    p["duplicate_ranks"], "0")
                out += results.goal(p["ranks_complete"], f"{where} {phase} ranks_complete", p["ranks_complete"],
                                    f"ranks 0..{n - 1} each once")
                out += results.goal(len(p["rounds"]) == 1, f"{where} {phase} rounds", p["rounds"], "one round")
                out += results.goal(p["worlds"] == [n], f"{where} {phase} worlds", p["worlds"], f"[{n}]")
            reform = r.get("reform") or {}
            if reform:
                out += results.goal(reform.get("newcomer_ranked") is True, f"{where} newcomer_ranked",
                                    reform.get("newcomer_ranked"), "the replacement or the spare took the place")
                out += results.goal(bool(reform.get("after_form_round")), f"{where} after_form_round",
                                    reform.get("after_form_round"), "a new round")
            if run.endswith(":spare"):
                spares = (r.get("form") or {}).get("spares_waiting")
                out += results.goal(spares == 1, f"{where} spares_waiting", spares, "1: the spare waits while the "
                                    "group is full")
    for key in ("reform_s_by_agents", "store_ops_per_agent_by_agents"):
        for n in result["agents"]:
            have = set((result.get(key) or {}).get(str(n)) or {})
            out += results.goal(have == set(result["runs"]), f"{key}[{n}]", sorted(have), f"one per run")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--agents", default=None, help=f"comma-separated N (default {FULL_AGENTS}, --quick {QUICK_AGENTS})")
    p.add_argument("--runs", default=None, help=f"comma-separated handler:scenario (default {RUNS})")
    p.add_argument("--procs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes for the agents")
    p.add_argument("--idle", type=float, default=None, help="seconds of training between the rounds (default 3 or two "
                   "keep-alive intervals, quick "
                   "1.5; more than a keep-alive interval: rule 5 keeps an agent that has not sent a heartbeat in its "
                   "round from expiry for 60 s)")
    p.add_argument("--store", choices=STORES, default="ddp_store", help="the store server: the rdzv pod's "
                   "(store/ddp_store, the default) or torch's own TCPStore server (the comparison)")
    p.add_argument("--keep-alive", type=int, default=KEEP_ALIVE_S, help="keep-alive interval in seconds (default "
                   f"{KEEP_ALIVE_S}, the operator's default; x{KEEP_ALIVE_ATTEMPTS} is the expiry)")
    p.add_argument("--agent-gc", action="store_true", help="the workers' garbage collector paced per agent, as if each "
                   "agent had a process of its own (_GcClock); recorded beside (the name ends in _agent_gc)")
    p.add_argument("--quick", action="store_true", help=f"N={QUICK_AGENTS}, runs {QUICK_RUNS} (smoke test)")
    results.add_record_arg(p)
    a = p.parse_args()
    agents = [int(x) for x in a.agents.split(",")] if a.agents else (QUICK_AGENTS if a.quick else FULL_AGENTS)
    runs = a.runs.split(",") if a.runs else (QUICK_RUNS if a.quick else RUNS)
    # training lasts longer than a keep-alive interval: rule 5 keeps an agent lost before its first heartbeat in a round
    idle = a.idle if a.idle is not None else (1.5 if a.quick else max(3.0, 2.0 * a.keep_alive))
    by_run: dict[str, dict[str, Any]] = {run: {} for run in runs}
    store, workers = Store(a.store), Workers(a.procs, a.agent_gc)
    peak_rss: dict[str, float] = {}
    try:
        for n in agents:
            for run in runs:
                started = time.time()
                by_run[run][str(n)] = r = one_run(run, n, workers, store, idle, a.keep_alive)
                print(f"{run} N={n}: {figures(r)} ({time.time() - started:.1f} s, load {os.getloadavg()[0]:.1f})",
                      file=sys.stderr, flush=True)
            peak_rss[str(n)] = store.peak_rss_mib()  # after every run up to N agents
    finally:
        workers.close()
        store.close()
    result = {"agents": agents, "procs": a.procs, "agent_gc": a.agent_gc, "store": a.store,
              "store_peak_rss_mib_by_agents": peak_rss,
              "keep_alive": [a.keep_alive, KEEP_ALIVE_ATTEMPTS],
              "launch_poll_s": LAUNCH_POLL_S, **summarize(by_run, agents), "runs": by_run,
              "loadavg_1m": round(os.getloadavg()[0], 2)}
    # torch's server is the comparison, recorded beside (docs/bench/rdzv_scale_torch_store.json)
    # a keep-alive other than the operator's default is recorded beside too (docs/bench/rdzv_scale_keep_alive_4s.json)
    name = "rdzv_scale" if a.store == "ddp_store" else "rdzv_scale_torch_store"
    if a.keep_alive != KEEP_ALIVE_S:
        name += f"_keep_alive_{a.keep_alive}s"
    if a.agent_gc:
        name += "_agent_gc"
    return results.emit_judged(name, result, goals_missed(result), mode="quick" if a.quick else "full",
                               record=a.record)


if __name__ == "__main__":
    sys.exit(main())
