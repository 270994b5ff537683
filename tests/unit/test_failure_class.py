"""Why a pod failed (failure_class.py), the budget each class spends (plan/failures.py), status.lastFailure, and the
nodes a job's replacement pods keep off (plan/avoid.py): a flaky node cannot exhaust the budget of a correct job,
while a crash loop in the user's code still fails fast."""

from ddp_operator import failure_class as fc
from ddp_operator import names
from ddp_operator.plan import CREATE, plan
from ddp_operator.plan.avoid import AVOID_SECONDS, avoided_nodes, kept_off

from ddp_builders import NOW, later, make_job, observed, rdzv, trainer

# What the kubelet keeps of a trainer whose script raised (its log's tail: the worker's traceback, then torchrun's).
PYTHON_ERROR = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/ddp/script/train.py", line 4, in <module>
[rank1]:     with open("config.json") as f:  # FileNotFoundError: hides in a comment
[rank1]: FileNotFoundError: [Errno 2] No such file or directory: 'config.json'
E1205 22:56:53.520000 29 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1) local_rank: 0
Traceback (most recent call last):
  File "/opt/venv/bin/torchrun", line 8, in <module>
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-05_22:56:53
  host      : job-1
  rank      : 1 (local_rank: 0)
  exitcode  : 1 (pid: 29)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================"""
NETWORK_ERROR = PYTHON_ERROR.replace(
    "FileNotFoundError: [Errno 2] No such file or directory: 'config.json'",
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.7]:4312")
SIGKILLED = "  rank      : 0 (local_rank: 0)\n  exitcode  : -9 (pid: 51)\n  Signal 9 (SIGKILL) received by PID 51"


def test_each_class_is_read_from_what_the_pod_left():
    user = fc.classify(exit_code=1, reason="Error", message=PYTHON_ERROR, disruption=None)
    assert (user.cls, user.reason, user.rank) == (fc.USER_CODE, "FileNotFoundError", 1)
    assert user.message.startswith("Traceback (most recent call last):")
    assert user.message.endswith("FileNotFoundError: [Errno 2] No such file or directory: 'config.json'")
    net = fc.classify(exit_code=1, reason="Error", message=NETWORK_ERROR, disruption=None)
    assert (net.cls, net.reason) == (fc.INFRASTRUCTURE, fc.REASON_NETWORK) and "Connection closed by peer" in net.message
    store = PYTHON_ERROR.replace("FileNotFoundError: [Errno 2] No such file or directory: 'config.json'",
                                 "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection "
                                 "to the C10d store has failed. See inner exception for details.")
    assert fc.classify(exit_code=1, reason="Error", message=store, disruption=None).reason == fc.REASON_NETWORK
    cases = {
        (fc.INFRASTRUCTURE, "Evicted"): dict(exit_code=None, reason="", message="", disruption="Evicted"),
        (fc.INFRASTRUCTURE, fc.REASON_POD_DELETED): dict(exit_code=None, reason="", message="", disruption=None,
                                                         deleted=True),
        (fc.INFRASTRUCTURE, fc.REASON_OOM): dict(exit_code=137, reason="OOMKilled", message="", disruption=None),
        (fc.INFRASTRUCTURE, fc.REASON_KILLED): dict(exit_code=1, reason="Error", message=SIGKILLED, disruption=None),
        (fc.USER_CODE, fc.REASON_EXIT_CODE): dict(exit_code=3, reason="Error", message="bye", disruption=None),
    }
    for (cls, reason), kw in cases.items():
        got = fc.classify(**kw)
        assert (got.cls, got.reason) == (cls, reason), kw


def test_hostile_text_never_raises_and_stays_bounded():
    for message in ("", "\x00" * 10000, "rank : 99999999999999", "Error: " * 5000, "Traceback\n" * 3000):
        got = fc.classify(exit_code=1, reason="x" * 10000, message=message, disruption=None)
        assert got.cls in fc.CLASSES and len(got.message) <= fc.MAX_MESSAGE


def _running(**policy):
    job = make_job(failurePolicy={"incidentWindowSeconds": 20, **policy})
    first = plan(job, {}, observed(service_exists=False), NOW)
    return job, plan(job, first.status, observed(rdzv(), trainer(0), trainer(1)), NOW).status


def _restart(status, job, seconds, message, node="node-1", n=1):
    return plan(job, status, observed(rdzv(), trainer(0), trainer(1, restart_count=n, last_exit_code=1,
                                                                    last_message=message, node=node)), later(seconds))


def test_infrastructure_failures_spend_their_own_budget_and_user_code_fails_fast():
    job, status = _running(backoffLimit=1, infraBackoffLimit=3)
    # Three network errors, far apart: the user's budget untouched, the job goes on.
    for n in (1, 2, 3):
        p = _restart(status, job, 100 * n, NETWORK_ERROR, n=n)
        assert p.status["phase"] != "Failed", p.status
        status = p.status
    assert (status.get("restarts", 0), status["infraRestarts"]) == (0, 3)
    assert status["lastFailure"] | {"time": "-"} == {
        "class": "Infrastructure", "reason": "NetworkError", "pod": "mnist-1", "node": "node-1", "rank": 1,
        "exitCode": 1, "message": status["lastFailure"]["message"], "time": "-", "budget": "infraBackoffLimit"}
    assert status["attempts"][-1]["class"] == "Infrastructure"
    # A fourth exceeds infraBackoffLimit.
    p = _restart(status, job, 400, NETWORK_ERROR, n=4)
    assert (p.status["phase"], p.status["reason"]) == ("Failed", names.REASON_INFRA_BACKOFF_LIMIT)
    # The user's code: two exceptions exceed backoffLimit=1 at once.
    job, status = _running(backoffLimit=1, infraBackoffLimit=3)
    p1 = _restart(status, job, 100, PYTHON_ERROR)
    assert (p1.status["restarts"], p1.status["lastFailure"]["budget"]) == (1, "backoffLimit")
    p2 = _restart(p1.status, job, 200, PYTHON_ERROR, n=2)
    assert (p2.status["phase"], p2.status["reason"]) == ("Failed", names.REASON_BACKOFF_LIMIT)
    assert p2.status["lastFailure"]["reason"] == "FileNotFoundError"


def test_an_incident_put_down_to_the_network_is_the_users_once_an_exception_shows_in_it():
    job, status = _running(backoffLimit=5)
    # Rank 0's agent reports the broken connection first, then rank 1's exception arrives within the window.
    first = plan(job, status, observed(rdzv(), trainer(0, restart_count=1, last_exit_code=1,
                                                       last_message=NETWORK_ERROR), trainer(1)), later(10))
    assert (first.status.get("restarts", 0), first.status["infraRestarts"]) == (0, 1)
    assert first.status["lastIncident"]["budget"] == "infraBackoffLimit"
    second = _restart(first.status, job, 12, PYTHON_ERROR)
    assert (second.status["restarts"], second.status.get("infraRestarts", 0)) == (1, 0)
    assert second.status["lastIncident"]["budget"] == "backoffLimit"
    # A restarted operator sees the same status: nothing moves again.
    again = _restart(second.status, job, 13, PYTHON_ERROR)
    assert (again.status["restarts"], again.status.get("infraRestarts", 0)) == (1, 0)


def test_a_node_that_failed_the_job_twice_is_kept_off_by_its_replacement_pods():
    job, status = _running()
    bad = dict(node="bad-node", exit_code=137, phase="Failed", reason="Error", message=SIGKILLED)
    p1 = plan(job, status, observed(rdzv(), trainer(0), trainer(1, **bad)), later(10))
    assert "avoidedNodes" not in p1.status
    back = plan(job, p1.status, observed(rdzv(), trainer(0)), later(11))
    p2 = plan(job, back.status, observed(rdzv(), trainer(0), trainer(1, uid="u2", **bad)), later(100))
    assert [a["node"] for a in p2.status["avoidedNodes"]] == ["bad-node"]
    assert any(e.reason == names.REASON_NODE_AVOIDED for e in p2.events)
    created = plan(job, p2.status, observed(rdzv(), trainer(0)), later(101))
    pod = next(a.body for a in created.actions if a.verb == CREATE and a.name == "mnist-1")
    preferred = pod["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred == [{"weight": 100, "preference": {"matchFields": [
        {"key": "metadata.name", "operator": "NotIn", "values": ["bad-node"]}]}}]
    # A preference: never a requirement that could leave the job nowhere to run (a one-node cluster).
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in pod["spec"]["affinity"]["nodeAffinity"]
    assert not any(e.reason == names.REASON_NODE_AVOIDED for e in created.events)  # said once
    # Lifted once its time is up.
    assert avoided_nodes(created.status["attempts"], later(100 + AVOID_SECONDS + 1)) == []


def test_failures_that_say_nothing_about_the_node_never_avoid_it():
    attempts = [{"class": "Infrastructure", "cause": cause, "node": "n1", "time": "2025-01-01T12:00:00Z"}
                for cause in ("OOMKilled", "PodDeleted", "PreemptionByScheduler")] + \
               [{"class": "UserCode", "cause": "ValueError", "node": "n1", "time": "2025-01-01T12:00:00Z"}] * 3
    assert avoided_nodes(attempts, NOW) == []


def test_one_node_loss_taking_several_pods_at_once_is_one_failure_of_the_node():
    attempts = [{"class": "Infrastructure", "cause": "NodeLost", "node": "n1", "time": f"2025-01-01T12:00:{s:02d}Z"}
                for s in (0, 1, 2)]
    assert avoided_nodes(attempts, NOW) == []
    attempts.append({"class": "Infrastructure", "cause": "NodeLost", "node": "n1", "time": "2025-01-01T12:05:00Z"})
    assert [(a["node"], a["failures"]) for a in avoided_nodes(attempts, NOW)] == [("n1", 2)]


def test_the_avoidance_keeps_the_templates_own_affinity():
    own = {"spec": {"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}]}]},
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 5, "preference": {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}}]}}}}
    out = kept_off(own, ["n2", "n1"])
    affinity = out["spec"]["affinity"]["nodeAffinity"]
    assert affinity["requiredDuringSchedulingIgnoredDuringExecution"] == \
        own["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert [p["weight"] for p in affinity["preferredDuringSchedulingIgnoredDuringExecution"]] == [5, 100]
    assert affinity["preferredDuringSchedulingIgnoredDuringExecution"][1]["preference"]["matchFields"][0]["values"] \
        == ["n1", "n2"]
    assert len(own["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]) == 1
    assert kept_off(own, []) is own


def test_an_image_that_cannot_be_pulled_is_infrastructure_with_the_kubelets_message():
    for reason in names.IMAGE_REASONS:
        f = fc.image_pull(reason, "container trainer: not found")
        assert (f.cls, f.reason, f.rank) == (fc.INFRASTRUCTURE, fc.REASON_IMAGE_PULL, None)
        assert f.message == f"{reason}: container trainer: not found"
    assert len(fc.image_pull("ErrImagePull", "x" * 10_000).message) == fc.MAX_MESSAGE
    assert fc.image_pull("ErrImagePull", "").message == "ErrImagePull"
    for other in ("CreateContainerConfigError", "Unschedulable", "CrashLoopBackOff", ""):
        assert fc.image_pull(other, "no") is None


def test_a_closed_rendezvous_is_no_network_error_but_its_own_echo():
    """torch's RendezvousClosedError is what an agent meets after another gave up (plan/rdzv_closed.py), not the
    network's fault; a connection error of the rendezvous still is."""
    closed = "  File \"x.py\", line 677, in run\n    raise RendezvousClosedError\n" \
             "torch.distributed.elastic.rendezvous.api.RendezvousClosedError"
    assert fc.rendezvous_closed(closed)
    assert fc.classify(exit_code=1, reason="Error", message=closed, disruption=None).reason != "NetworkError"
    assert not fc.rendezvous_closed("FileNotFoundError: config.json") and not fc.rendezvous_closed("")
    assert not fc.rendezvous_closed(closed + "\n" + "\n".join(f"later line {i}" for i in range(20)))
    conn = "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store"
    assert fc.classify(exit_code=1, reason="Error", message=conn, disruption=None).reason == "NetworkError"
