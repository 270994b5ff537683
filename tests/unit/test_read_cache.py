"""read_cache.ReadCache: what the node-loss rule reads of nodes, reused for a while, the missing ones read side by
side, each once however many passes ask."""

from __future__ import annotations

import threading
import time

import pytest

from ddp_operator.read_cache import ReadCache


def test_the_missing_names_are_read_side_by_side_and_then_reused():
    """The storm pass of a 1,000-node job read its 50 lost nodes one round trip after the other (0.9 s before it
    acted). Here every read waits until all four are in flight: read one after the other, the barrier breaks."""
    barrier, reads = threading.Barrier(4, timeout=5), []

    def read(name):
        reads.append(name)
        barrier.wait()
        return f"state of {name}"

    cache = ReadCache(60)
    names = ["n1", "n2", "n3", "n4", "n2"]
    assert cache.get_many(names, read) == {n: f"state of {n}" for n in names}
    assert sorted(reads) == ["n1", "n2", "n3", "n4"]
    assert cache.get_many(["n3"], read) == {"n3": "state of n3"} and len(reads) == 4  # reused
    assert cache.get("n1", read) == "state of n1" and len(reads) == 4


def test_a_name_being_read_for_one_pass_is_not_read_again_for_another():
    started, release, reads = threading.Event(), threading.Event(), []

    def read(name):
        reads.append(name)
        started.set()
        release.wait(5)
        return name.upper()

    cache, results = ReadCache(60), []
    first = threading.Thread(target=lambda: results.append(cache.get_many(["a", "b"], read)))
    first.start()
    assert started.wait(5)
    second = threading.Thread(target=lambda: results.append(cache.get_many(["b"], read)))
    second.start()
    time.sleep(0.2)
    release.set()
    first.join(5), second.join(5)
    assert sorted(reads) == ["a", "b"]  # b once, for both passes
    assert {"b": "B"} in results and {"a": "A", "b": "B"} in results


def test_a_failed_read_raises_in_every_pass_that_asked_and_is_not_kept():
    started, release, calls = threading.Event(), threading.Event(), []

    def read(name):
        calls.append(name)
        started.set()
        release.wait(5)
        if len(calls) == 1:
            raise RuntimeError("the API server said no")
        return "ok"

    cache, errors = ReadCache(60), []

    def ask():
        try:
            cache.get("n", read)
        except RuntimeError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=ask)]
    threads[0].start()
    assert started.wait(5)
    threads.append(threading.Thread(target=ask))
    threads[1].start()
    time.sleep(0.2)
    release.set()
    for t in threads:
        t.join(5)
    assert errors == ["the API server said no"] * 2
    assert cache.get("n", read) == "ok" and calls == ["n", "n"]  # read again: nothing was kept


def test_entries_expire():
    cache, reads = ReadCache(0.0), []
    cache.get("n", reads.append)
    cache.get("n", reads.append)
    assert reads == ["n", "n"]
    with pytest.raises(KeyError):
        cache.get_many(["x"], lambda name: {}[name])
