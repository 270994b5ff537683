"""The operator's allocator settings (operator/ddp_operator/memory.py), in a process of their own: glibc's arenas are
per process and a cap only holds for threads started after it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ddp_operator import memory

OPERATOR = Path(__file__).resolve().parents[2] / "operator"

# 12 threads alive at once, each allocating through malloc (bytes of 4 KiB: above pymalloc's 512), then glibc's own
# account of its heaps (malloc_info: one <heap> per arena).
PROBE = textwrap.dedent("""
    import ctypes, os, sys, tempfile, threading
    sys.path.insert(0, {operator!r})
    from ddp_operator import memory
    if {cap}:
        assert memory.limit_arenas(2)
    barrier, held = threading.Barrier(12), []
    def work():
        held.append([bytes(4096) for _ in range(64)])
        barrier.wait()
    threads = [threading.Thread(target=work) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    libc = ctypes.CDLL("libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    fd, path = tempfile.mkstemp()
    os.close(fd)
    fp = ctypes.c_void_p(libc.fopen(path.encode(), b"w"))
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    print(open(path).read().count("<heap nr="))
    os.unlink(path)
""")


def heaps(cap: bool) -> int:
    env = {"PATH": "/usr/bin:/bin"}  # no MALLOC_ARENA_MAX from the caller
    out = subprocess.run([sys.executable, "-c", PROBE.format(operator=str(OPERATOR), cap=cap)], env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    return int(out.stdout.split()[-1])


needs_glibc = pytest.mark.skipif(not memory.available(), reason="the C library is not glibc")


@needs_glibc
def test_the_arena_cap_holds_the_threads_to_two_heaps_where_glibc_gives_them_more():
    assert heaps(cap=False) > 2
    assert heaps(cap=True) == 2


# A thread's arena filled with 4 KiB chunks (about 160 MiB), a chunk allocated above them, then the rest freed: the
# heap's top cannot shrink past that chunk, so the freed pages stay resident until trimmed. VmRSS in MiB before and
# after memory.trim().
TRIM_PROBE = textwrap.dedent("""
    import sys, threading
    sys.path.insert(0, {operator!r})
    from ddp_operator import memory
    def rss():
        return next(int(line.split()[1]) // 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))
    kept = []
    def work():
        held = [bytes(4096) for _ in range(40000)]
        kept.append(bytes(4096))
        del held
    t = threading.Thread(target=work)
    t.start()
    t.join()
    before = rss()
    assert memory.trim()
    print(before, rss())
""")


@needs_glibc
def test_trim_gives_a_threads_freed_pages_back_to_the_system():
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE.format(operator=str(OPERATOR))],
                         env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60, check=True)
    before, after = map(int, out.stdout.split()[-2:])
    assert before > 120, (before, after)  # freed, but still resident
    assert after < before - 100, (before, after)


@needs_glibc
def test_the_trimmer_stops_when_told():
    import threading

    stop = threading.Event()
    thread = memory.start_trimming(stop, every=0.01)
    assert thread is not None and thread.daemon
    stop.set()
    thread.join(2)
    assert not thread.is_alive()


def test_an_arena_cap_below_one_is_refused():
    assert memory.limit_arenas(0) is False
