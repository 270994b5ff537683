"""The diagnostics sidecar's server: what each torchrun worker of this pod does (docs/diagnostics.md, "The sidecar",
says what every field of the answer means and how it is read).

`python3 diagnose.py [--port 29402] [--py-spy PATH] [--root-pid PID] [--host 0.0.0.0]` runs in the TRAINER's image as
the trainer's user, in the pod's shared process namespace: any python3 >= 3.8, its standard library only.
Workers: processes whose /proc environ has TORCHELASTIC_RUN_ID, RANK and LOCAL_RANK (torchrun's), or that
ddp_trainer.launch forked from its forkserver (named WORKER_NAME: their ranks are read from torch's elastic `_wrap`
frame); not the agent, nor a worker's own children. `GET /diagnosis` reads every worker's main thread with
`py-spy dump --json --locals` (all at once; a sample is kept CACHE_S) and /proc; `?log=<reason>` also prints every
worker's full stacks to stdout. Nothing read is trusted: a process gone mid-read is skipped, output that is not a
dump is a reason.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple
from urllib.parse import parse_qs, urlsplit

VERSION = 1
# ddp_operator.names.DIAGNOSTICS_PORT/_PATH and ddp_trainer.launch.WORKER_NAME (a test holds them equal)
PORT, PATH, WORKER_NAME = 29402, "/diagnosis", "ddp-worker"
RUN_ID, RANK, LOCAL_RANK, WORLD_SIZE = "TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE"
ENV_KEYS = (RUN_ID, RANK, LOCAL_RANK, WORLD_SIZE)
PY_SPY_TIMEOUT_S, CACHE_S, SOCKET_TIMEOUT_S = 5.0, 1.0, 5.0
MAX_WORKERS, MAX_PARALLEL = 64, 16      # workers in an answer (the operator reads no more), py-spy runs at once
MAX_TEXT, MAX_REPR = 512, 300           # characters of a frame in the answer, of a local in the printed stacks
MAX_DUMP, MAX_ENVIRON = 32 << 20, 1 << 20  # bytes read of py-spy's output, of /proc/<pid>/environ
PERMISSION_HINT = ("py-spy: permission denied (it needs the workers' user, and CAP_SYS_PTRACE where "
                   "kernel.yama.ptrace_scope is 1: spec.diagnostics.ptrace)")
C10D = "torch/distributed/distributed_c10d.py"
ELASTIC_API = "torch/distributed/elastic/multiprocessing/api.py"
STDLIB = re.compile(r"/lib/python\d+(\.\d+)?/")
ENV_ITEM = re.compile(r'"([A-Z_][A-Z0-9_]*)": "([^"\\]*)"')


# --- /proc ---------------------------------------------------------------------------------------
class Proc(NamedTuple):
    pid: int
    ppid: int
    comm: str
    state: str
    cpu_ticks: int
    env: Dict[str, str]       # ENV_KEYS only


def parse_stat(text: str) -> Optional[Proc]:
    """/proc/<pid>/stat, env empty: the name (in parentheses) may hold anything, so count from the last ')'."""
    try:
        rest = text[text.rindex(")") + 2:].split()
        return Proc(int(text[:text.index("(")]), int(rest[1]), text[text.index("(") + 1:text.rindex(")")], rest[0],
                    int(rest[11]) + int(rest[12]), {})
    except (ValueError, IndexError):
        return None


def parse_environ(data: bytes) -> Dict[str, str]:
    pairs = (item.partition(b"=") for item in data.split(b"\0"))
    return {k.decode("ascii", "replace"): v.decode("utf-8", "replace") for k, sep, v in pairs
            if sep and k.decode("ascii", "replace") in ENV_KEYS}


def read_proc(pid: int, root: str = "/proc") -> Optional[Proc]:
    """One process, or None once it is gone; an environ it may not read reads as empty."""
    try:
        with open(f"{root}/{pid}/stat", "rb") as f:
            p = parse_stat(f.read().decode("utf-8", "replace"))
    except OSError:
        return None
    try:
        with open(f"{root}/{pid}/environ", "rb") as f:
            return p and p._replace(env=parse_environ(f.read(MAX_ENVIRON)))
    except OSError:
        return p


def scan(root: str = "/proc") -> Dict[int, Proc]:
    try:
        found = [read_proc(int(entry), root) for entry in os.listdir(root) if entry.isdigit()]
    except OSError:
        return {}
    return {p.pid: p for p in found if p is not None}


def select_workers(procs: Dict[int, Proc], root: Optional[int]) -> List[int]:
    """The worker pids among `procs` (descendants of `root` only, when given): see the module doc."""
    def key(p: Proc) -> tuple:
        return (p.env.get(RUN_ID), p.env.get(RANK), p.env.get(LOCAL_RANK))

    def descends(pid: int) -> bool:
        seen = set()
        while pid in procs and pid not in seen:  # a ppid cycle: /proc read while processes came and went
            seen.add(pid)
            pid = procs[pid].ppid
            if pid == root:
                return True
        return False

    cands = {pid: p for pid, p in procs.items() if p.state not in ("Z", "X") and (root is None or descends(pid))
             and (all(k in p.env for k in (RUN_ID, RANK, LOCAL_RANK)) or p.comm == WORKER_NAME)}
    workers = []
    for pid, p in cands.items():
        parent = cands.get(p.ppid)
        if parent is not None and (parent.comm == WORKER_NAME or key(parent) == key(p)):
            continue  # started by a worker (a DataLoader worker)
        if p.comm != WORKER_NAME and any(c.ppid == pid and key(c) != key(p) for c in cands.values()):
            continue  # the agent: its children are workers of other ranks
        workers.append(pid)
    return sorted(workers)


# --- stacks --------------------------------------------------------------------------------------
class DumpError(Exception):
    """py-spy's output is not a stack dump: the message is the `stacks` reason."""


class Frame(NamedTuple):
    name: str
    filename: str
    short: str                # py-spy's short_filename
    line: Optional[int]
    locals: Tuple[Tuple[str, str], ...]


class Thread(NamedTuple):
    os_tid: Optional[int]
    name: str
    active: bool
    frames: Tuple[Frame, ...]  # innermost first


def _printable(text: str, limit: int) -> str:
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def parse_dump(data: bytes) -> List[Thread]:
    """`py-spy dump --json --locals` output -> its threads, as far as they can be read; DumpError if none can."""
    try:
        doc = json.loads(data[:MAX_DUMP].decode("utf-8"))  # a dump cut short is no JSON
    except (ValueError, RecursionError):
        raise DumpError("py-spy: output is not JSON") from None

    def _int(value: Any) -> Optional[int]:
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def _str(value: Any, default: str = "") -> str:
        return value if isinstance(value, str) else default

    def frame(raw: dict) -> Frame:
        local_vars = raw.get("locals")
        pairs = tuple((v["name"], v["repr"]) for v in (local_vars if isinstance(local_vars, list) else ())
                      if isinstance(v, dict) and isinstance(v.get("name"), str) and isinstance(v.get("repr"), str))
        filename = _str(raw.get("filename"))
        return Frame(_str(raw.get("name"), "?"), filename, _str(raw.get("short_filename"), filename),
                     _int(raw.get("line")), pairs)

    threads = [Thread(_int(t.get("os_thread_id")), _str(t.get("thread_name")), t.get("active") is True,
                      tuple(frame(f) for f in t["frames"] if isinstance(f, dict)))
               for t in (doc if isinstance(doc, list) else ())
               if isinstance(t, dict) and isinstance(t.get("frames"), list)]
    if not threads:
        raise DumpError("py-spy: output is not a stack dump")
    return threads


def main_frames(threads: List[Thread], pid: int) -> Optional[Tuple[Frame, ...]]:
    """The main thread's frames: the thread whose OS id is the pid, else the one named MainThread, else the first."""
    main = [t for t in threads if t.os_tid == pid] or [t for t in threads if t.name == "MainThread"] or threads
    return main[0].frames if main else None


def _in(f: Frame, path: str) -> bool:
    return f.short.startswith(path) or ("/" + path) in f.filename


def is_user(f: Frame) -> bool:
    """Outside torch, the standard library and site-packages: the script's own code."""
    name = f.filename
    return bool(name) and not name.startswith("<") and "/site-packages/" not in name and \
        "/dist-packages/" not in name and not STDLIB.search(name) and not f.short.startswith("torch/")


def frame_text(f: Frame) -> str:
    return _printable(f"{f.name} ({f.short or '?'}{'' if f.line is None else f':{f.line}'})", MAX_TEXT)


def phase(frames: Tuple[Frame, ...]) -> str:
    if not frames:
        return "unknown"
    if any(f.name == "init_process_group" and _in(f, C10D) for f in frames):
        return "init"

    def waits(f: Frame) -> bool:  # in torch.distributed (not the launcher's wrappers), or in autograd's backward
        if _in(f, "torch/distributed/"):
            return not _in(f, "torch/distributed/elastic/")
        return (_in(f, "torch/autograd/") or _in(f, "torch/_tensor.py")) and "backward" in f.name

    user = next((i for i, f in enumerate(frames) if is_user(f)), len(frames))
    called = frames[:user]
    # An import (module code run by importlib: `import torch.distributed` at the top of a script) is no collective.
    if any(f.name == "<module>" or "importlib" in f.filename for f in called):
        return "running"
    return "collective" if any(waits(f) for f in called) else "running"


def _num(text: Optional[str], low: int = 0) -> Optional[int]:
    """A decimal of at most 9 digits, at least `low` (torch's "not set" is -1); else None."""
    n = int(text) if text is not None and re.fullmatch(r"-?\d{1,9}", text) else None
    return n if n is not None and n >= low else None


def _local(f: Frame, name: str, low: int = 0) -> Optional[int]:
    return _num(next((v for k, v in f.locals if k == name), None), low)


def claimed(frames: Tuple[Frame, ...]) -> Tuple[Optional[int], Optional[int]]:
    """The (rank, world size) a worker in init_process_group claims; None where it claims nothing (yet)."""
    init = next((i for i, f in enumerate(frames) if f.name == "init_process_group" and _in(f, C10D)), None)
    if init is None:
        return None, None
    for f in frames[:init]:
        if f.name == "_new_process_group_helper" and _in(f, C10D):
            rank, size = _local(f, "group_rank"), _local(f, "group_size", 1)
            if rank is not None and size is not None:
                return rank, size
    return _local(frames[init], "rank"), _local(frames[init], "world_size", 1)


def env_from_frames(frames: Tuple[Frame, ...]) -> Dict[str, str]:
    """A forked worker's RANK/WORLD_SIZE/LOCAL_RANK from torch's elastic `_wrap` frame (its env_ and local_rank)."""
    for f in frames:
        if f.name == "_wrap" and _in(f, ELASTIC_API):
            local = _local(f, "local_rank")
            env = {LOCAL_RANK: str(local)} if local is not None else {}
            return dict(env, **{k: v for k, v in ENV_ITEM.findall(dict(f.locals).get("env_", "")) if k in ENV_KEYS})
    return {}


def worker_report(p: Proc, threads: Optional[List[Thread]], clk_tck: int) -> Dict[str, Any]:
    """One worker's entry of the answer; `threads` None: no stacks."""
    frames = main_frames(threads, p.pid) if threads is not None else None
    env = dict(p.env) if RANK in p.env or not frames else dict(p.env, **env_from_frames(frames))
    env_rank, world = _num(env.get(RANK)), _num(env.get(WORLD_SIZE), 1)
    out = {"pid": p.pid, "rank": env_rank, "envRank": env_rank, "localRank": _num(env.get(LOCAL_RANK)),
           "worldSize": world, "cpuSeconds": round(p.cpu_ticks / clk_tck, 3), "phase": "unknown", "frame": None,
           "userFrame": None, "digest": None}
    if frames:
        rank, size = claimed(frames)
        user = next((f for f in frames if is_user(f)), None)
        text = "\n".join(f"{f.name}\t{f.filename}\t{f.line}" for f in frames)  # not the locals: they change
        out.update(rank=env_rank if rank is None else rank, worldSize=world if size is None else size,
                   phase=phase(frames), frame=frame_text(frames[0]), userFrame=user and frame_text(user),
                   digest=hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:16])
    return out


# --- py-spy --------------------------------------------------------------------------------------
Dump = Tuple[Optional[List[Thread]], Optional[str]]  # (the threads, None) or (None, why not)


def spy_failure(stderr: bytes, rc: int) -> str:
    """py-spy's error output -> one line."""
    text = stderr.decode("utf-8", "replace")
    if re.search(r"permission denied|operation not permitted|os error (1|13)\)", text, re.IGNORECASE):
        return PERMISSION_HINT
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    first = first[len("Error: "):] if first.startswith("Error: ") else first
    return "py-spy: " + _printable(first, 200) if first else f"py-spy: failed (exit {rc})"


def spy_problem(path: str) -> Optional[str]:
    """Why py-spy at `path` cannot run at all (None: it may)."""
    if not os.path.isfile(path):
        return f"py-spy: not found at {path}"
    return None if os.access(path, os.X_OK) else f"py-spy: not executable: {path}"


def run_py_spy(path: str, pid: int, timeout: float = PY_SPY_TIMEOUT_S) -> Dump:
    cmd = [path, "dump", "--pid", str(pid), "--json", "--locals"]
    try:
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
                              env=dict(os.environ, RUST_BACKTRACE="0"))
    except subprocess.TimeoutExpired:
        return None, f"py-spy: timed out after {timeout:g} s"
    except OSError as e:
        return None, f"py-spy: {e.strerror or e}"
    if done.returncode != 0:
        return None, spy_failure(done.stderr, done.returncode)
    try:
        return parse_dump(done.stdout), None
    except DumpError as e:
        return None, str(e)


def py_spy_version(path: str) -> str:
    try:
        done = subprocess.run([path, "--version"], stdin=subprocess.DEVNULL, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unusable: {spy_problem(path) or e}"
    out = done.stdout.decode("utf-8", "replace").strip()
    return out if done.returncode == 0 and out else f"unusable: {spy_failure(done.stderr, done.returncode)}"


# --- a sample ------------------------------------------------------------------------------------
Entry = Tuple[Dict[str, Any], Optional[List[Thread]], Optional[str]]  # (a worker's entry, its threads, why none)


Sample = NamedTuple("Sample", [("report", Dict[str, Any]), ("entries", List[Entry])])


def take_sample(py_spy: str, root: Optional[int], *, scan: Callable[[], Dict[int, Proc]] = scan,
                spy: Optional[Callable[[str, int], Dump]] = None, read: Callable[[int], Optional[Proc]] = read_proc,
                now: Callable[[], float] = time.time) -> Sample:
    pids = select_workers(scan(), root)[:MAX_WORKERS]
    problem = spy_problem(py_spy)
    dumps: Dict[int, Dump] = {}
    if problem is None and pids:
        with ThreadPoolExecutor(max_workers=min(len(pids), MAX_PARALLEL)) as pool:
            dumps = dict(zip(pids, pool.map(lambda pid: (spy or run_py_spy)(py_spy, pid), pids)))
    clk_tck = os.sysconf("SC_CLK_TCK")
    entries = []
    for pid in pids:
        p = read(pid)  # after the dumps: CPU time as fresh as the stacks, and a worker gone meanwhile is skipped
        if p is not None:
            threads, why = dumps.get(pid, (None, problem))
            entries.append((worker_report(p, threads, clk_tck), threads, why))
    entries.sort(key=lambda e: (e[0]["envRank"] is None, e[0]["envRank"] or 0, e[0]["pid"]))
    stacks = next((why for _, threads, why in entries if threads is None and why), problem or "ok")
    return Sample({"version": VERSION, "time": round(now(), 3), "stacks": stacks,
                   "workers": [e[0] for e in entries]}, entries)


class Sampler:
    """One sample at a time, kept for `max_age` seconds: probes that come together wait for the same one."""

    def __init__(self, take: Callable[[], Any], max_age: float = CACHE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._take, self._max_age, self._clock = take, max_age, clock
        self._lock, self._sample, self._at = threading.Lock(), None, 0.0

    def get(self) -> Any:
        with self._lock:
            if self._sample is None or self._clock() - self._at > self._max_age:
                self._sample, self._at = self._take(), self._clock()
            return self._sample


def format_stacks(reason: str, when: float, entries: List[Entry]) -> str:
    """Every worker's full stacks (all threads), as `?log=<reason>` prints them; the locals of library frames only,
    never the script's own (they may hold its secrets, and whoever reads the pod's logs would read them)."""
    n, stamp = len(entries), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))
    lines = [f"=== stacks: {reason} at {stamp} ({n} worker{'' if n == 1 else 's'}) ==="]
    for w, threads, why in entries:
        lines.append(f"--- worker pid {w['pid']}: rank {w['rank']} (env rank {w['envRank']}, local rank "
                     f"{w['localRank']}) of {w['worldSize']}, phase {w['phase']}, cpu {w['cpuSeconds']} s ---")
        if threads is None:
            lines.append(f"    no stacks: {why}")
        for t in threads or ():
            lines.append(f'Thread {t.os_tid} "{_printable(t.name, 100)}" ({"active" if t.active else "idle"})')
            for f in t.frames:
                lines.append("    " + frame_text(f))
                if not is_user(f):
                    lines.extend(f"        {_printable(k, 100)} = {_printable(v, MAX_REPR)}" for k, v in f.locals)
    lines.append("=== end of stacks ===")
    return "\n".join(lines) + "\n"


# --- the server ----------------------------------------------------------------------------------
class Handler(BaseHTTPRequestHandler):
    timeout = SOCKET_TIMEOUT_S  # a client that sends nothing is dropped
    server_version = "ddp-diagnostics"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urlsplit(self.path)
        if url.path != PATH:
            self._send(404, {"error": f"not found: GET {PATH}"})
            return
        try:
            sample = self.server.sampler.get()  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - an answer, never a dead server
            self._send(500, {"error": _printable(f"{type(e).__name__}: {e}", MAX_TEXT)})
            return
        query = parse_qs(url.query, keep_blank_values=True)
        if "log" in query:
            reason = re.sub(r"[^A-Za-z0-9_.:=/-]", "_", query["log"][0])[:100] or "-"
            self.server.log_stacks(reason, sample)  # type: ignore[attr-defined]
        self._send(200, sample.report)

    def _send(self, code: int, body: Dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the client left

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        pass  # a line per probe would bury the stacks


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: Tuple[str, int], sampler: Sampler, out: Any = sys.stdout) -> None:
        super().__init__(address, Handler)
        self.sampler, self.out, self._print = sampler, out, threading.Lock()

    def log_stacks(self, reason: str, sample: Sample) -> None:
        text = format_stacks(reason, sample.report["time"], sample.entries)
        with self._print:
            self.out.write(text)
            self.out.flush()


def main(argv: Optional[List[str]] = None) -> int:
    beside = os.path.join(os.path.dirname(os.path.abspath(__file__)), "py-spy")  # where the init container puts it
    parser = argparse.ArgumentParser(description="What each torchrun worker of this pod is doing, as JSON.")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=PORT)
    parser.add_argument("--py-spy", default=beside if os.path.isfile(beside) else shutil.which("py-spy") or beside)
    parser.add_argument("--root-pid", type=int, help="only workers descended from this process (tests)")
    args = parser.parse_args(argv)
    try:
        server = Server((args.host, args.port), Sampler(lambda: take_sample(args.py_spy, args.root_pid)))
    except OSError as e:
        print(f"ddp-diagnostics: cannot serve on {args.host}:{args.port}: {e}", flush=True)
        return 1
    scope = f" (workers under pid {args.root_pid})" if args.root_pid is not None else ""
    print(f"ddp-diagnostics: serving http://{args.host}:{server.server_address[1]}{PATH}{scope}; "
          f"py-spy {args.py_spy}: {py_spy_version(args.py_spy)}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
