"""The operator and Kueue that `make test` installs once for the pytest runs it starts side by side.

    python -m tests.e2e.shared_release up     # both images, Kueue, the chart with its Kueue integration on
    python -m tests.e2e.shared_release down   # the chart, then Kueue, removed

In one pytest session the `shared_operator` and `kueue_operator` fixtures (tests/conftest.py) install them at their
first use and remove them when the session ends. Two sessions at once (hack/test.sh: the e2e tier beside the
integration tier and the benchmarks) cannot share a fixture, so `up` installs both before them and they run with
DDPJOB_OPERATOR=installed, which uses the release it finds; `down` removes both after. The chart excludes the
integration tier's namespaces (harness.Operator: watch.exclude), whose own operators run beside it.
"""

from __future__ import annotations

import sys

from tests.e2e import harness
from tests.support.kube import Kubectl, connect


def _operator(kueue: bool) -> harness.Operator:
    cluster = connect()
    return harness.Operator(cluster, Kubectl(cluster.kubeconfig), "helm", kueue=kueue)


def up() -> None:
    op = _operator(kueue=True)
    harness.ensure_images(op.cluster)
    mod = harness.kueue_module()
    harness.log(f"kueue up: {mod.up(op.cluster.kubeconfig, kind_cluster=op.cluster.kind_name)}")
    op.start()


def down() -> None:
    op = _operator(kueue=True)
    op.installed_here = True  # installed by `up`, in another process
    op.stop()
    harness.kueue_module().down(op.cluster.kubeconfig)


def main(argv: list[str]) -> int:
    commands = {"up": up, "down": down}
    if len(argv) != 1 or argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    commands[argv[0]]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
