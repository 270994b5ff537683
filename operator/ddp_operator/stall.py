"""Stalls (docs/diagnostics.md): a process group that never forms, a script that reports nothing and stands still.
What the diagnostics sidecars' answers mean. Pure.

Every trainer pod's sidecar answers `GET /diagnosis` with what each torchrun worker of the pod is doing: the rank
and world size it claims, its phase (`init` inside init_process_group, `collective` waiting in torch.distributed or
backward, `running`, `unknown` without stacks), its innermost frame and the user's, a digest of its stack and its
CPU time. `valid_diagnosis` turns one answer into a `Diagnosis` (every field checked, bounded: the answers come from
the job's own pods). The shell (poller.py) keeps a `StallWatch` per job and asks:

- `startup_due`: the incarnation (its running trainer pods) has not formed its process group (a worker still in
  `init`) within failurePolicy.processGroupTimeoutSeconds of a worker first seen in `init` (a slow import or data
  load before init_process_group on a busy node is not the group failing to form). `startup_finding` then says why
  in one line: the ranks that never joined and where their workers are, ranks claimed twice, a claimed world size
  that is not the job's. Its `signature` (the missing and duplicate ranks, the world sizes) is equal for the same
  fault after a restart.
- `silent_hang_due`: the group formed, no pod ever reported progress (a plain script), and no worker's stack digest
  nor the workers' CPU time moved for failurePolicy.hangTimeoutSeconds. `hang_finding` names the stuck pods: those
  whose workers are outside the collective the others wait in, else the highest index.

The planner (plan/stall.py, plan/hang.py) acts on the findings and records `describe`'s ranks in status.diagnosis.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ddp_operator import names
from ddp_operator.report import real, shown
from ddp_operator.status import listed

# Bounds of what one answer may hold (more workers than any node runs; a frame is one line).
MAX_WORKERS = 64
MAX_TEXT = 512
MAX_ID = 2 ** 31
MAX_CPU_SECONDS = 2.0 ** 40
MAX_INVALID_SHOWN = 32
# status.diagnosis.ranks holds at most this many entries; a message at most this many characters.
MAX_RANKS = 64
MAX_MESSAGE = 1024
# The silent-hang clock restarts when the workers' CPU time grew by more than this many cores over the interval.
CPU_MOVE_CORES = 0.1
# How many missing ranks a start-up finding describes one by one.
RANKS_DESCRIBED = 3

PHASE_INIT = "init"
PHASE_COLLECTIVE = "collective"
PHASE_RUNNING = "running"
PHASE_UNKNOWN = "unknown"
PHASES = (PHASE_INIT, PHASE_COLLECTIVE, PHASE_RUNNING, PHASE_UNKNOWN)
STACKS_OK = "ok"


@dataclass(frozen=True)
class Worker:
    pid: int
    rank: int | None          # the rank it claims (init_process_group's, else its environment's)
    env_rank: int | None      # its environment's RANK (torchrun's)
    local_rank: int | None
    world_size: int | None    # the world size it claims
    cpu_seconds: float | None
    phase: str                # PHASES
    frame: str | None         # the main thread's innermost frame
    user_frame: str | None    # the innermost frame of the user's code
    digest: str | None        # a hash of the main thread's frames


@dataclass(frozen=True)
class Diagnosis:
    stacks: str               # "ok" or why not
    workers: tuple[Worker, ...]


@dataclass(frozen=True)
class PodDiagnosis:
    uid: str
    name: str
    index: int
    diagnosis: Diagnosis | None   # None: the sidecar did not answer


@dataclass(frozen=True)
class Finding:
    reason: str                   # REASON_PG_NEVER_FORMED, REASON_HANG, or REASON_PG_FORMED (clears Stalled)
    message: str                  # the one line of the condition and the Event
    signature: str                # equal iff the same diagnosis, across restarts
    stuck: tuple[str, ...]        # pod UIDs to delete
    ranks: tuple[Mapping[str, Any], ...] = ()   # status.diagnosis.ranks


# --- one answer ----------------------------------------------------------------------------------
def _id(value: Any, low: int = 0) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and low <= value < MAX_ID else None


def text(value: Any, limit: int = MAX_TEXT) -> str | None:
    """A string fit for a status or a message: printable, at most `limit` characters; None if not a string."""
    if not isinstance(value, str):
        return None
    head = value[:limit]
    return "".join(c if c.isprintable() else "?" for c in head)


def _phase(value: Any) -> str | None:
    return value if isinstance(value, str) and value in PHASES else None


def _cpu(value: Any) -> float | None:
    return real(value, 0.0, MAX_CPU_SECONDS)


_WORKER_FIELDS = {
    "rank": ("rank", _id), "envRank": ("env_rank", _id), "localRank": ("local_rank", _id),
    "worldSize": ("world_size", lambda v: _id(v, 1)), "cpuSeconds": ("cpu_seconds", _cpu),
    "frame": ("frame", text), "userFrame": ("user_frame", text), "digest": ("digest", text),
}


def _worker(raw: Any, where: str, invalid: list[str]) -> Worker | None:
    if not isinstance(raw, Mapping):
        invalid.append(where)
        return None
    pid = _id(raw.get("pid"), 1)
    if pid is None:
        invalid.append(f"{where}.pid")
        return None  # whose the rest is cannot be told
    fields: dict[str, Any] = {}
    for key, (attr, rule) in _WORKER_FIELDS.items():
        value = raw.get(key)
        clean = rule(value) if value is not None else None
        if value is not None and clean is None:
            invalid.append(f"{where}.{key}")
        fields[attr] = clean
    phase = _phase(raw.get("phase"))
    if phase is None:
        invalid.append(f"{where}.phase")
    return Worker(pid=pid, phase=phase or PHASE_UNKNOWN, **fields)


def valid_diagnosis(answer: Any) -> tuple[Diagnosis | None, tuple[str, ...]]:
    """One sidecar's answer (docs/diagnostics.md) with every field checked: (the usable parts, the names of the
    invalid fields). An answer that is not an object is nobody's (None). At most MAX_WORKERS workers are read
    (more is an invalid `workers`), strings are cut to MAX_TEXT characters. Never raises."""
    if not isinstance(answer, Mapping):
        return None, ()
    invalid: list[str] = []
    stacks = text(answer.get("stacks"))
    if stacks is None:
        invalid.append("stacks")
        stacks = "not reported"
    raw = answer.get("workers")
    workers: list[Worker] = []
    if isinstance(raw, list):
        if len(raw) > MAX_WORKERS:
            invalid.append("workers")
        seen: set[int] = set()
        for i, item in enumerate(raw[:MAX_WORKERS]):
            w = _worker(item, f"workers[{i}]", invalid)
            if w is not None and w.pid in seen:
                invalid.append(f"workers[{i}].pid")
            elif w is not None:
                seen.add(w.pid)
                workers.append(w)
    elif raw is not None:
        invalid.append("workers")
    shown_invalid = [shown(n) for n in invalid[:MAX_INVALID_SHOWN]]
    if len(invalid) > MAX_INVALID_SHOWN:
        shown_invalid.append(f"... {len(invalid) - MAX_INVALID_SHOWN} more")
    return Diagnosis(stacks=stacks, workers=tuple(workers)), tuple(shown_invalid)


# --- the clocks ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StallWatch:
    """What the poller keeps of a job between probes: the incarnation (its running trainer pods' UIDs) and since
    when a worker of it waits in init_process_group (`init_since`, monotonic seconds of the probe that first saw
    one; None before), whether its process group formed and whether any pod reported progress (both sticky), and
    for the silent-hang clock the stacks and CPU time last seen to move and since when."""

    incarnation: tuple[str, ...]
    init_since: float | None
    formed: bool
    reporting: bool
    fingerprint: tuple | None
    since: float
    cpu: float | None


def formed(diagnoses: Sequence[PodDiagnosis]) -> bool | None:
    """False while a worker is in `init`; True when none is and some worker waits in a collective, which only a
    formed group can run; None when it cannot be told (no answer, no worker, no stacks, or every worker in its own
    code: a script still loading its data before init_process_group looks exactly like one training between
    collectives, so only a collective seen proves the group formed)."""
    workers = [w for d in diagnoses if d.diagnosis is not None for w in d.diagnosis.workers]
    if any(w.phase == PHASE_INIT for w in workers):
        return False
    if any(w.phase == PHASE_COLLECTIVE for w in workers):
        return True
    return None


def _fingerprint(diagnoses: Sequence[PodDiagnosis]) -> tuple:
    return tuple(sorted((d.uid, tuple(sorted((w.pid, w.digest) for w in d.diagnosis.workers))
                         if d.diagnosis is not None else None) for d in diagnoses))


def _cpu_total(diagnoses: Sequence[PodDiagnosis]) -> float | None:
    values = [w.cpu_seconds for d in diagnoses if d.diagnosis is not None for w in d.diagnosis.workers]
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def watch(prev: StallWatch | None, incarnation: tuple[str, ...], diagnoses: Sequence[PodDiagnosis],
          reporting: bool, now: float) -> StallWatch:
    """The watch after a probe of every pod's sidecar. `reporting`: some pod answered the progress endpoint with a
    valid step in this incarnation. A new incarnation starts a new watch. The silent-hang clock (`since`) restarts
    when the group forms, when a worker's stack digest (or its set of workers) changes, and when the workers' CPU
    time grew by more than CPU_MOVE_CORES cores since it last restarted; a probe nobody answered changes nothing."""
    cpu = _cpu_total(diagnoses)
    fingerprint = _fingerprint(diagnoses)
    # A training step reported is as good a proof as a collective seen: the sidecars need not be asked again.
    seen = formed(diagnoses)
    is_formed = seen is True or reporting
    in_init = seen is False
    if prev is None or prev.incarnation != incarnation:
        return StallWatch(incarnation, now if in_init else None, is_formed, reporting, fingerprint, now, cpu)
    reporting = prev.reporting or reporting
    is_formed = is_formed or reporting
    if all(d.diagnosis is None for d in diagnoses):
        return StallWatch(incarnation, prev.init_since, prev.formed or reporting, reporting, prev.fingerprint,
                          prev.since, prev.cpu)
    init_since = prev.init_since if prev.init_since is not None else (now if in_init else None)
    if not prev.formed and is_formed:
        return StallWatch(incarnation, init_since, True, reporting, fingerprint, now, cpu)
    elapsed = max(now - prev.since, 0.0)
    moved = fingerprint != prev.fingerprint or (cpu is not None and prev.cpu is not None and
                                                cpu - prev.cpu > CPU_MOVE_CORES * elapsed) or \
        (cpu is not None and prev.cpu is None)
    if moved:
        return StallWatch(incarnation, init_since, prev.formed, reporting, fingerprint, now, cpu)
    return StallWatch(incarnation, init_since, prev.formed, reporting, prev.fingerprint, prev.since, prev.cpu)


def startup_due(w: StallWatch | None, timeout: int, now: float) -> bool:
    """The incarnation's process group did not form within `timeout` seconds (0: off) of a worker first seen waiting
    in init_process_group."""
    return (w is not None and not w.formed and w.init_since is not None and timeout > 0
            and now - w.init_since >= timeout)


def silent_hang_due(w: StallWatch | None, hang_timeout: int, now: float) -> bool:
    """A formed group whose pods never reported progress stood still (stacks, CPU) for `hang_timeout` (0: off)."""
    return w is not None and w.formed and not w.reporting and hang_timeout > 0 and now - w.since >= hang_timeout


def expected_world_size(nodes: int, nproc_per_node: int) -> int:
    """The world size of a job: spec.nodes x spec.nprocPerNode (spec.py resolves `auto`, and torchrun is given that
    number, so the product is what each worker's WORLD_SIZE says)."""
    return nodes * nproc_per_node


# --- what the answers say ------------------------------------------------------------------------
def _where(w: Worker) -> str:
    return w.user_frame or w.frame or "an unknown frame"


def _pods(names_: Iterable[str]) -> str:
    pods = sorted(set(names_))
    return ("pod " if len(pods) == 1 else "pods ") + listed(pods, 8)


def _ranks_text(ranks: Sequence[int]) -> str:
    return listed([str(r) for r in ranks], 8)


def _times(n: int) -> str:
    return "twice" if n == 2 else f"{n} times"


def cut(message: str) -> str:
    """A message at most MAX_MESSAGE characters long."""
    return message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE - 3] + "..."


def describe(diagnoses: Sequence[PodDiagnosis]) -> tuple[Mapping[str, Any], ...]:
    """status.diagnosis.ranks: every worker's claimed rank, pod, phase and frames (by rank, at most MAX_RANKS)."""
    entries = []
    for d in sorted(diagnoses, key=lambda d: d.index):
        if d.diagnosis is None:
            continue
        for w in d.diagnosis.workers:
            rank = w.rank if w.rank is not None else w.env_rank
            entry = {"rank": rank, "pod": d.name, "phase": w.phase, "frame": w.frame, "userFrame": w.user_frame}
            entries.append({k: v for k, v in entry.items() if v is not None})
    entries.sort(key=lambda e: (e.get("rank") is None, e.get("rank") or 0, e["pod"]))
    return tuple(entries[:MAX_RANKS])


def _claims(diagnoses: Sequence[PodDiagnosis]) -> list[tuple[PodDiagnosis, Worker]]:
    return [(d, w) for d in sorted(diagnoses, key=lambda d: d.index) if d.diagnosis is not None
            for w in d.diagnosis.workers]


def _missing_why(rank: int, claims: list[tuple[PodDiagnosis, Worker]], diagnoses: Sequence[PodDiagnosis]) -> str:
    """Where the worker torchrun gave RANK=`rank` is, or why it cannot be seen."""
    own = [(d, w) for d, w in claims if w.env_rank == rank]
    if own:
        d, w = own[0]
        if w.rank is not None and w.rank != rank:
            return f"pod {d.name}: its worker with RANK={rank} claims rank {w.rank}"
        if w.phase == PHASE_UNKNOWN:
            return f"pod {d.name}: no stacks ({d.diagnosis.stacks if d.diagnosis else 'no answer'})"
        return f"pod {d.name}: waits in {_where(w)}"
    silent = [d.name for d in diagnoses if d.diagnosis is None]
    idle = [d.name for d in diagnoses if d.diagnosis is not None and not d.diagnosis.workers]
    why = []
    if idle:
        why.append(f"no worker runs in {_pods(idle)}")
    if silent:
        why.append(f"the diagnostics sidecar of {_pods(silent)} did not answer")
    return "; ".join(why) or "no worker has it"


def startup_finding(diagnoses: Sequence[PodDiagnosis], world_size: int | None) -> Finding | None:
    """Why the process group did not form, from every pod's diagnosis: None when it formed, or when no answer shows
    a worker in init_process_group (nothing to tell). `world_size`: the job's (expected_world_size); 0 or None: the
    world size most workers claim."""
    if formed(diagnoses) is not False:
        return None
    claims = _claims(diagnoses)
    sizes = Counter(w.world_size for _, w in claims if w.world_size is not None)
    world = world_size or (sizes.most_common(1)[0][0] if sizes else 0)
    by_rank: dict[int, list[tuple[PodDiagnosis, Worker]]] = {}
    for d, w in claims:
        # Only a worker in (or past) init_process_group has joined: before it, its rank is its environment's.
        if w.rank is not None and w.phase in (PHASE_INIT, PHASE_COLLECTIVE):
            by_rank.setdefault(w.rank, []).append((d, w))
    missing = [r for r in range(world) if r not in by_rank] if world else []
    duplicate = sorted(r for r, who in by_rank.items() if len(who) > 1)
    outside = sorted(r for r in by_rank if world and r >= world)
    wrong_sizes = sorted(s for s in sizes if world and s != world)
    parts = []
    for r in missing[:RANKS_DESCRIBED]:
        parts.append(f"global rank {r} of {world} never joined ({_missing_why(r, claims, diagnoses)})")
    if len(missing) > RANKS_DESCRIBED:
        parts.append(f"global ranks {_ranks_text(missing[RANKS_DESCRIBED:])} of {world} never joined either")
    for r in duplicate[:RANKS_DESCRIBED]:
        parts.append(f"rank {r} claimed {_times(len(by_rank[r]))} ({_pods(d.name for d, _ in by_rank[r])})")
    if len(duplicate) > RANKS_DESCRIBED:
        parts.append(f"ranks {_ranks_text(duplicate[RANKS_DESCRIBED:])} claimed more than once too")
    if outside:
        parts.append(f"rank{'s' if len(outside) > 1 else ''} {_ranks_text(outside)} claimed "
                     f"({_pods(d.name for r in outside for d, _ in by_rank[r])}), outside the world of {world}")
    for s in wrong_sizes[:RANKS_DESCRIBED]:
        parts.append(f"world size {s} claimed ({_pods(d.name for d, w in claims if w.world_size == s)}), "
                     f"the job's is {world}")
    if not parts:
        waiting = next((w for _, w in claims if w.phase == PHASE_INIT), None)
        parts.append(f"every rank of {world or len(claims)} joined but init_process_group did not complete "
                     f"(waits in {waiting.frame if waiting and waiting.frame else 'init_process_group'}): the "
                     f"workers cannot reach each other (a NetworkPolicy or firewall between the pods?)")
    signature = (f"missing={','.join(map(str, missing))};duplicate={','.join(map(str, duplicate))};"
                 f"outside={','.join(map(str, outside))};world={world};claimed={','.join(map(str, sorted(sizes)))}")
    return Finding(names.REASON_PG_NEVER_FORMED, cut("; ".join(parts)), signature,
                   tuple(d.uid for d in sorted(diagnoses, key=lambda d: d.index)), describe(diagnoses))


def hang_finding(diagnoses: Sequence[PodDiagnosis]) -> Finding | None:
    """The stuck pods of a silent hang: those whose workers are outside the collective (or init) the others wait
    in, and pods whose sidecar did not answer (only when another pod answered); when that is every pod or none,
    the highest index alone (of the pods that run workers). None when no pod answered."""
    # A pod that answered with no worker (a spare, or a torchrun between restarts) is not in the collective at all.
    pods = sorted((d for d in diagnoses if d.diagnosis is None or d.diagnosis.workers), key=lambda d: d.index)
    if not pods or all(d.diagnosis is None for d in pods):
        return None
    waiting_phases = (PHASE_COLLECTIVE, PHASE_INIT)
    outside = [d for d in pods if d.diagnosis is None or any(w.phase == PHASE_RUNNING for w in d.diagnosis.workers)]
    tie = not 0 < len(outside) < len(pods)
    stuck = [pods[-1]] if tie else outside
    waiting = next((w for d in pods if d not in stuck and d.diagnosis is not None for w in d.diagnosis.workers
                    if w.phase in waiting_phases), None)
    parts = []
    for d in stuck[:RANKS_DESCRIBED]:
        if d.diagnosis is None:
            parts.append(f"pod {d.name}: its diagnostics sidecar did not answer")
            continue
        ws = sorted(d.diagnosis.workers, key=lambda w: (w.phase != PHASE_RUNNING, w.rank if w.rank is not None
                                                        else MAX_ID))
        if not ws:
            parts.append(f"pod {d.name}: runs no worker")
            continue
        w = ws[0]
        rank = w.rank if w.rank is not None else w.env_rank
        parts.append(f"global rank {rank if rank is not None else '?'} (pod {d.name}) stands still in {_where(w)}")
    if len(stuck) > RANKS_DESCRIBED:
        parts.append(f"and {len(stuck) - RANKS_DESCRIBED} more pods")
    if tie:
        parts.append("no rank is apart from the others (the highest index is replaced)")
    elif waiting is not None:
        parts.append(f"the other ranks wait in {waiting.frame or 'a collective'}")
    ranks = sorted(w.rank for d in stuck if d.diagnosis is not None for w in d.diagnosis.workers
                   if w.rank is not None)
    signature = f"hang={','.join(d.name for d in stuck)};ranks={','.join(map(str, ranks))}"
    return Finding(names.REASON_HANG, cut("; ".join(parts)), signature, tuple(d.uid for d in stuck),
                   describe(diagnoses))


def formed_finding() -> Finding:
    """The job's process group formed (the poller saw it while condition Stalled was True): Stalled turns False."""
    return Finding(names.REASON_PG_FORMED, "every rank joined the process group", "", ())


def frame_of(diagnosis: Diagnosis | None) -> str | None:
    """The frame a pod stands in, for a message: its first worker outside a collective, else its first worker."""
    if diagnosis is None or not diagnosis.workers:
        return None
    ws = sorted(diagnosis.workers, key=lambda w: (w.phase != PHASE_RUNNING, w.rank if w.rank is not None else MAX_ID))
    return ws[0].user_frame or ws[0].frame


def incarnation_id(uids: Iterable[str]) -> str:
    """A short, stable name for a set of pods (status.diagnosis.incarnation): another set, another name."""
    return hashlib.sha256("\n".join(sorted(uids)).encode()).hexdigest()[:16]
