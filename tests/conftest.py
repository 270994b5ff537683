"""Suite-wide fixtures and hooks: a real Kubernetes cluster and the means to use it from tests. The helpers behind
them are plain modules under tests/support/ (what tests, tests/e2e/harness.py and the benchmark programs import).

- `cluster` (session): the cluster under test. The embedded cluster of hack/cluster.py, brought up
  when needed and left up afterwards (a second session starts in a second, not a minute; a cluster
  another checkout of this host runs is reused); or the cluster `DDPJOB_TEST_KUBECONFIG` names (kind:
  `make kind-e2e` sets it for the cluster it made). `$KUBECONFIG` is never used: it may point at a
  real cluster, and the tests install CRDs, Helm releases and pods and restart the embedded cluster.
  When the cluster cannot be reached or started, the session fails with the reason when CI=true and
  skips cluster tests otherwise. `cluster.found` lists what the session found on the cluster that is
  not the tests' (non-system namespaces, workloads in `default`): the restart tests leave such a
  cluster alone.
- `kubectl` (session): kubectl bound to that cluster: `kubectl("get", "pods")` returns the
  CompletedProcess (raising with stdout/stderr on failure unless check=False), `kubectl.json(...)`
  the parsed `-o json` output.
- `foreign_operators_paused` (session): DDPJob operators the session did not install that watch
  every namespace (e.g. `make demo`'s release) would reconcile the tests' jobs too; tests that run
  operators of their own request it: such Deployments are scaled to 0 and restored to their replica
  count when the session ends.
- `namespace` (function): a fresh namespace per test, deleted afterwards; when the test failed,
  its pods, events, descriptions and container logs are printed first (shown in the report).
- `wait_for` (tests/support/waiting.py's function): poll a condition with a timeout, never a fixed sleep.
- `ensure_image`: make a locally built image available to the cluster (embedded: hack/image.py
  into containerd, a no-op when nothing changed; kind: docker build + kind load, or offline
  (DDPJOB_IMAGE_BUILDER=buildah) buildah + hack/image.py kind-load).
- Tests marked `cluster_restart` (they stop the cluster) run after every other test.
"""
from __future__ import annotations

import re
import secrets
from pathlib import Path

import pytest

from tests.support.kube import (
    Cluster,
    Kubectl,
    connect,
    create_test_namespace,
    dump_namespace,
    ensure_image,
    foreign_operators_paused_in,
    not_the_tests,
)
from tests.support.suite import IN_CI, Teardowns, forbid_skip_in_ci, tier_timeout
from tests.support.waiting import wait_for


# --------------------------------------------------------------------------------------------
# fixtures

@pytest.fixture(scope="session")
def cluster() -> Cluster:
    try:
        c = connect()
    except Exception as e:  # noqa: BLE001 - any reason the cluster cannot be used
        msg = f"the cluster under test is not available: {e}"
        if IN_CI:
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return Cluster(c.kubeconfig, c.embedded, c.kind_name, found=not_the_tests(c.kubeconfig))


@pytest.fixture(scope="session")
def kubectl(cluster) -> Kubectl:
    return Kubectl(cluster.kubeconfig)


@pytest.fixture
def namespace(request, kubectl) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = create_test_namespace(kubectl, f"t-{base}-{secrets.token_hex(3)}")
    yield name
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(dump_namespace(kubectl, name))
    kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


@pytest.fixture(scope="session")
def foreign_operators_paused(kubectl):
    with foreign_operators_paused_in(kubectl) as paused:
        yield paused


# The shared operator and Kueue are removed before a test that restarts the cluster, not after it.
SHARED = Teardowns()


@pytest.fixture(scope="session")
def shared_operator(cluster, kubectl, request):
    """The one operator of the e2e tests and the cluster benchmarks (tests/e2e/harness.py, DDPJOB_OPERATOR), started
    at its first use and stopped when the session ends: a chart installed here is uninstalled then. One install per
    session, not one per module. The integration and chart tiers, which run operators of their own, are collected
    before the tiers that use it; a cluster-restart test (run last) has it removed first."""
    from tests.e2e import harness
    if harness.operator_mode() == "subprocess":  # helm mode reuses an installed release instead
        request.getfixturevalue("foreign_operators_paused")
    harness.ensure_images(cluster)
    op = harness.Operator(cluster, kubectl).start()
    SHARED.push(op.stop)
    yield op
    SHARED.run(op.stop)


@pytest.fixture(scope="session")
def kueue_operator(shared_operator, cluster):
    """Kueue in the cluster (hack/kueue.py; installed at the first use, removed when the session ends if it was not
    there before) and the shared operator with its Kueue integration on from then on: jobs without a queue label are
    not gated, so the tests and benchmarks after the first Kueue test run against the same operator."""
    from tests.e2e import harness
    mod = harness.kueue_module()
    was_there = mod.release(cluster.kubeconfig) is not None
    harness.log(f"kueue up: {mod.up(cluster.kubeconfig, kind_cluster=cluster.kind_name)}")
    kueue_before = shared_operator.kueue

    def teardown():
        if not was_there:
            if not shared_operator.installed_here:  # someone else's release: as it was found
                shared_operator.set_kueue(kueue_before)
            mod.down(cluster.kubeconfig)
    SHARED.push(teardown)
    yield shared_operator.set_kueue(True)
    SHARED.run(teardown)



@pytest.fixture(autouse=True)
def _shared_removed_before_a_restart(request):
    if request.node.get_closest_marker("cluster_restart") is not None:
        SHARED.run_all()


@pytest.fixture(name="wait_for")
def wait_for_fixture():
    return wait_for


@pytest.fixture(name="ensure_image", scope="session")
def ensure_image_fixture(cluster):
    """ensure_image(ref, dockerfile, context, build_args=None) for the session's cluster."""
    return lambda ref, dockerfile, context, build_args=None: ensure_image(cluster, ref, dockerfile, context,
                                                                           build_args)


# --------------------------------------------------------------------------------------------
# hooks

def pytest_configure(config):
    config.addinivalue_line("markers", "cluster_restart: stops and restarts the cluster; runs last")


def pytest_collection_modifyitems(config, items):
    # Restarting the cluster wipes its API objects; anything else in the session runs before it.
    items.sort(key=lambda item: item.get_closest_marker("cluster_restart") is not None)
    # Each tier's time limit (tests/support/suite.py TIER_TIMEOUTS), unless the test sets its own.
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(tier_timeout(Path(str(item.fspath)))))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # Keep each phase's report on the item so fixtures can tell, in teardown, that the test failed.
    outcome = yield
    rep = outcome.get_result()
    forbid_skip_in_ci(rep)  # tests/support/suite.py CI_ALLOWED_SKIPS
    setattr(item, f"rep_{rep.when}", rep)
