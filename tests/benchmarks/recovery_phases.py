"""Where the seconds of one recovery go: milestones from the components that see them, and the phases between.

Pure functions over timestamped log lines (no cluster): e2e_recovery.py collects the lines of one kill and
reports the median of each phase over its kills. Every time is the host's wall clock: the container
runtime stamps each log line (`kubectl logs --timestamps`) on the node, which on the embedded cluster and on
kind is this machine; the operator stamps its own lines; the trainer's session line carries /proc start
times of the worker and of its parent, torchrun's agent (the container's first process).

Milestones of a lost trainer pod, in the order a recovery passes them (absolute times, None when not seen):

- `kill`: the force-delete was sent;
- `collective_failed`: a survivor's worker printed the error of its broken collective (first such line);
- `survivor_agent_rendezvous`: the last survivor's agent entered the next rendezvous (its worker exited);
- `operator_saw`: the operator logged the pod's loss; `replacement_created`: it logged creating the pod again;
- `scheduled`: the scheduler bound the replacement (its Scheduled event, microseconds);
- `agent_started`: the replacement container's first process, torchrun's agent, started;
- `agent_rendezvous`: that agent entered the rendezvous (torch imported, the agent set up);
- `round_complete`: the last member's agent logged the round complete (the dead node's keep-alives expired,
  every member joined);
- `process_up` / `init_called` / `pg_ready`: the slowest worker of the new round started, reached
  `init_session` (interpreter, torch and the script's imports) and joined the process group;
- `restored`: the state was restored (rank 0's resume line, after the script built its data, model and DDP);
- `first_step`: the first optimizer step after it.

With a hot spare the replacement is not on the path (the spare's agent waits in the rendezvous already):
the rendezvous phase starts when the survivors' agents enter it.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Mapping

# (phase, from milestone, to milestone, what happens): the critical path of a recovery with a replacement pod
PHASES: tuple[tuple[str, str, str, str], ...] = (
    ("failure_seen", "kill", "collective_failed", "a survivor's all-reduce fails (the peer's TCP connections reset)"),
    ("survivor_worker_exit", "collective_failed", "survivor_agent_rendezvous",
     "the survivor's worker exits and its agent enters the next rendezvous"),
    ("operator_sees_loss", "kill", "operator_saw", "the operator's watch delivers the pod's deletion"),
    ("replacement_created", "operator_saw", "replacement_created", "the operator creates the pod again"),
    ("scheduled", "replacement_created", "scheduled",
     "the scheduler binds it (may precede the operator's log line of the create: then negative)"),
    ("container_started", "scheduled", "agent_started", "the kubelet starts its sandbox and container"),
    ("agent_up", "agent_started", "agent_rendezvous", "its agent imports torch and joins the rendezvous"),
    ("rendezvous", "rendezvous_start", "round_complete",
     "the dead node's keep-alives expire, the round fills and completes"),
    ("workers_spawned", "round_complete", "process_up", "the agents start their workers"),
    ("worker_imports", "process_up", "init_called", "a worker's interpreter and imports, up to init_session"),
    ("process_group", "init_called", "pg_ready", "init_process_group (every rank joins)"),
    ("script_setup_and_restore", "pg_ready", "restored",
     "the script builds its data, model and DDP, and the state is restored (from a peer)"),
    ("first_step", "restored", "first_step", "the first optimizer step after the restore"),
)

_COLLECTIVE_ERROR = re.compile(r"^\[rank\d+\]:|Error")
_RENDEZVOUSING = "Rendezvous'ing worker group"
_ROUND_COMPLETE = "Rendezvous complete for workers"
_FIELD = re.compile(r"(\w+)=(\S+)")

Lines = list[tuple[float, str]]


def _first(lines: Iterable[tuple[float, str]], after: float, match) -> float | None:
    return next((t for t, line in lines if t >= after and match(line)), None)


def _last(lines: Iterable[tuple[float, str]], after: float, until: float, match) -> float | None:
    found = [t for t, line in lines if after <= t <= until and match(line)]
    return found[-1] if found else None


def _max(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _sessions(lines: Lines, after: float, until: float) -> list[dict[str, str]]:
    """The trainer's `event=session` lines in the window, as fields (with the runtime's stamp as `at`)."""
    out = []
    for t, line in lines:
        if after <= t <= until and " ddp_trainer " in line and "event=session" in line:
            out.append({**dict(_FIELD.findall(line.partition(" ddp_trainer ")[2])), "at": str(t)})
    return out


def milestones(*, kill: float, restored: float, first_step: float, victim: str,
               survivors: Mapping[str, Lines], members: Mapping[str, Lines], replacement: Lines | None,
               operator: Lines, scheduled: float | None) -> dict[str, float | None]:
    """Absolute times of one recovery's milestones (module docstring).

    `survivors`: log lines of the pods that lived through the kill; `members`: of every pod of the round that
    resumed (survivors and the replacement or spare); `replacement`: the victim's replacement pod's lines when it
    is a member of that round (None with a spare); `operator`: the operator's lines; `scheduled`: the
    replacement's Scheduled event time.
    """
    m: dict[str, float | None] = {"kill": kill, "restored": restored, "first_step": first_step}
    m["collective_failed"] = min((t for t in (_first(lines, kill, _COLLECTIVE_ERROR.search)
                                              for lines in survivors.values()) if t is not None), default=None)
    m["survivor_agent_rendezvous"] = _max(_first(lines, kill, lambda s: _RENDEZVOUSING in s)
                                          for lines in survivors.values())
    # the pod's name followed by a space or a quote: "pod job-1 was deleted", never job-10
    named = re.compile(rf"\bpod {re.escape(victim)}\b(?!-)")
    m["operator_saw"] = _first(operator, kill, lambda s: bool(named.search(s)) and "created" not in s)
    # text or JSON log lines ("...created Pod job-1" or "...created Pod job-1", ...}): never job-10
    created = re.compile(rf"created Pod {re.escape(victim)}\b(?!-)")
    m["replacement_created"] = _first(operator, kill, lambda s: bool(created.search(s)))
    m["scheduled"] = scheduled if replacement is not None else None
    sessions = {pod: _sessions(lines, kill, restored) for pod, lines in members.items()}
    last = {pod: s[-1] for pod, s in sessions.items() if s}
    m["agent_started"] = m["agent_rendezvous"] = None
    if replacement is not None:
        own = _sessions(replacement, kill, restored)
        m["agent_started"] = float(own[-1]["agent_started"]) if own and "agent_started" in own[-1] else None
        m["agent_rendezvous"] = _first(replacement, kill, lambda s: _RENDEZVOUSING in s)
    m["rendezvous_start"] = _max((m["survivor_agent_rendezvous"], m["agent_rendezvous"]))
    m["round_complete"] = _max(_last(lines, kill, restored, lambda s: _ROUND_COMPLETE in s)
                               for lines in members.values())
    m["process_up"] = _max(float(s["process_started"]) for s in last.values() if "process_started" in s)
    m["init_called"] = _max(float(s["init_called"]) for s in last.values() if "init_called" in s)
    m["pg_ready"] = _max(float(s["at"]) for s in last.values())
    return m


def phases(m: Mapping[str, float | None]) -> dict[str, float | None]:
    """Seconds of each phase of PHASES (None where a milestone is missing)."""
    out: dict[str, float | None] = {}
    for name, start, end, _ in PHASES:
        a, b = m.get(start), m.get(end)
        out[name] = None if a is None or b is None else round(b - a, 3)
    return out


def since_kill(m: Mapping[str, float | None]) -> dict[str, float | None]:
    """Each milestone as seconds after the kill (the kill itself at 0: phases() takes either form)."""
    kill = m["kill"]
    assert kill is not None
    return {k: None if v is None else round(v - kill, 3) for k, v in m.items()}


def medians(rows: Iterable[Mapping[str, float | None]]) -> dict[str, float | None]:
    """The median of each key over the rows that have it (keys in the first row's order)."""
    rows = list(rows)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    out = {}
    for key in keys:
        values = [r[key] for r in rows if r.get(key) is not None]
        out[key] = round(statistics.median(values), 3) if values else None
    return out
