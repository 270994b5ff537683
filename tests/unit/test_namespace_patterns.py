"""tests/support/kube.py `watches`: which namespaces an operator with given --namespace patterns handles (the
integration tier pauses only the operators that would handle its ddp-it-* namespaces), the same as kopf decides."""

from __future__ import annotations

import pytest
from kopf._cogs.structs.references import match_namespace  # kopf's own rule, to compare with

from tests.support.kube import watches

PATTERNS = [[], ["team-a"], ["team-a", "team-b"], ["!ddp-it-*"], ["!ddp-it-*,!sand?x"], ["ddp-*"],
            ["myapp-*, !*-pr-*, *pr-123"], ["!*-pr-*, *pr-123"]]
NAMESPACES = ["team-a", "team-b", "ddp-it-1a2b", "ddp-e2e-x", "sandbx", "myapp-test", "myapp-pr-123",
              "myapp-pr-456", "otherapp-pr-123", "default"]


@pytest.mark.parametrize("patterns", PATTERNS, ids=lambda p: "|".join(p) or "all")
def test_the_rule_is_kopfs(patterns):
    for ns in NAMESPACES:
        want = not patterns or any(match_namespace(ns, p) for p in patterns)
        assert watches(patterns, ns) is want, (patterns, ns)


def test_the_shared_operator_leaves_the_integration_namespaces_alone():
    assert not watches(["!ddp-it-*"], "ddp-it-0f3c")
    assert watches(["!ddp-it-*"], "ddp-e2e-kill") and watches(["!ddp-it-*"], "bench-api-1")
