"""The operator and Kueue that `make test` installs once for the pytest runs it starts side by side.

    python -m tests.e2e.shared_release up     # both images, Kueue, the chart with its Kueue integration on
    python -m tests.e2e.shared_release down   # what `up` installed, removed (the chart, then Kueue)

In one pytest session the `shared_operator` and `kueue_operator` fixtures (tests/conftest.py) install them at their
first use and remove them when the session ends. Two sessions at once (hack/test.sh: the e2e tier beside the
integration tier and the benchmark smoke tests) cannot share a fixture, so `up` installs both before them and they
run with DDPJOB_OPERATOR=installed, which uses the release it finds; `down` removes both after. The chart excludes the
namespaces of the tests that run operators of their own (harness.Operator: watch.exclude).

A release or a Kueue found by `up` (e.g. `make demo`'s, which has the same name) is upgraded to the tests' values,
and `down` leaves it installed, with its Kueue integration off again where `up` installed Kueue: `up` records what it
installed in .test-results/shared-release.json.
"""

from __future__ import annotations

import json
import sys

from tests.e2e import harness
from tests.support.kube import Kubectl, connect
from tests.support.suite import REPO

RECORD = REPO / ".test-results" / "shared-release.json"


def _operator(kueue: bool) -> harness.Operator:
    cluster = connect()
    return harness.Operator(cluster, Kubectl(cluster.kubeconfig), "helm", kueue=kueue)


def up() -> None:
    op = _operator(kueue=True)
    harness.ensure_images(op.cluster)
    mod = harness.kueue_module()
    kueue_found = mod.release(op.cluster.kubeconfig) is not None
    harness.log(f"kueue up: {mod.up(op.cluster.kubeconfig, kind_cluster=op.cluster.kind_name)}")
    op.start()
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps({"operator_installed": op.installed_here, "kueue_installed": not kueue_found}))


def down() -> None:
    installed = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    op = _operator(kueue=True)
    if installed.get("operator_installed"):
        op.installed_here = True
        op.stop()
    elif installed.get("kueue_installed"):
        op.set_kueue(False)  # a release found here: its Kueue integration off before Kueue goes
    if installed.get("kueue_installed"):
        harness.kueue_module().down(op.cluster.kubeconfig)
    RECORD.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    commands = {"up": up, "down": down}
    if len(argv) != 1 or argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    commands[argv[0]]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
