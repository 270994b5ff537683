"""pod_hash.py: every pod the operator creates carries ddp.dev/template-hash, the same for pods of one shape (across
indexes, groups and passes), another once what shapes the pods changes."""

from __future__ import annotations

import re

from ddp_operator import names
from ddp_operator.plan import CREATE, plan
from ddp_operator.pod import render_trainer_pod
from ddp_operator.pod_hash import template_hash, with_template_hash
from ddp_operator.rdzv import render_rdzv_pod
from ddp_operator.spec import parse_job

from ddp_builders import NOW, job_body, later, make_job, observed, rdzv, trainer

LABEL = names.LABEL_TEMPLATE_HASH


def _created(p) -> dict[str, dict]:
    return {a.name: a.body for a in p.actions if a.verb == CREATE and a.kind == "Pod"}


def test_same_spec_same_hash_across_pods_and_passes():
    job = make_job(spares=1)
    first = plan(job, {}, observed(service_exists=False), NOW)
    pods = _created(first)
    trainers = {pods[f"mnist-{i}"]["metadata"]["labels"][LABEL] for i in range(3)}
    assert len(trainers) == 1  # pod 0, pod 1 and the spare: one shape
    (value,) = trainers
    assert re.fullmatch(r"[0-9a-f]{10}", value)
    # A later pass replaces a lost pod: the replacement has the shape (and the hash) of the others.
    running = plan(job, first.status, observed(rdzv(), trainer(0), trainer(1), trainer(2)), later(5))
    again = plan(job, running.status, observed(rdzv(), trainer(0), trainer(2)), later(10))
    assert _created(again)["mnist-1"]["metadata"]["labels"][LABEL] == value
    # The store pod has its own shape, hashed the same way.
    store = pods["mnist-rdzv"]["metadata"]["labels"][LABEL]
    assert store != value and store == template_hash(render_rdzv_pod(job, 0))


def test_per_pod_parts_do_not_change_it():
    job = make_job()
    hashes = {template_hash(render_trainer_pod(job, index, group)) for index in range(4) for group in (0, 3)}
    assert len(hashes) == 1  # name, hostname, node index, group, rendezvous id: per pod, not its shape
    pod = render_trainer_pod(job, 0, 0)
    pod["metadata"]["annotations"] = {**pod["metadata"].get("annotations", {}), names.NODES_ANNOTATION: "7"}
    assert template_hash(pod) in hashes  # the desired size the operator keeps current on live pods
    assert template_hash(with_template_hash(render_trainer_pod(job, 1, 0))) in hashes  # its own label aside


def test_placement_of_one_creation_does_not_change_it():
    """Kueue's admission and the avoided nodes are applied after the hash is taken: where a pod goes, not its shape."""
    job, running = make_job(), None
    bad = dict(node="bad-node", exit_code=137, phase="Failed", reason="Error")
    first = plan(job, {}, observed(service_exists=False), NOW)
    value = _created(first)["mnist-0"]["metadata"]["labels"][LABEL]
    running = plan(job, first.status, observed(rdzv(), trainer(0), trainer(1)), later(1))
    p1 = plan(job, running.status, observed(rdzv(), trainer(0), trainer(1, **bad)), later(10))
    back = plan(job, p1.status, observed(rdzv(), trainer(0)), later(11))
    p2 = plan(job, back.status, observed(rdzv(), trainer(0), trainer(1, uid="u2", **bad)), later(100))
    created = _created(plan(job, p2.status, observed(rdzv(), trainer(0)), later(101)))["mnist-1"]
    assert created["spec"]["affinity"]["nodeAffinity"]  # kept off bad-node...
    assert created["metadata"]["labels"][LABEL] == value  # ...with the same shape


def test_what_shapes_the_pod_changes_it():
    base = template_hash(render_trainer_pod(make_job(), 0, 0))

    def changed(edit) -> str:
        body = job_body()
        edit(body["spec"])
        return template_hash(render_trainer_pod(parse_job(body), 0, 0))
    trainer_c = lambda s: s["template"]["spec"]["containers"][0]  # noqa: E731
    assert changed(lambda s: trainer_c(s).update(image="localhost/ddp-trainer:0.2.0")) != base
    assert changed(lambda s: trainer_c(s).update(env=[{"name": "LR", "value": "0.1"}])) != base
    assert changed(lambda s: s["template"].update(metadata={"labels": {"team": "a"}})) != base
    assert changed(lambda s: s.update(diagnostics={"enabled": False})) != base
    assert changed(lambda s: s["template"].update(metadata={"annotations": {names.SPREAD_ANNOTATION: "false"}})) != base
    assert changed(lambda s: None) == base


def test_an_operator_that_renders_pods_differently_gives_them_another_hash(monkeypatch):
    """An upgrade that changes the pod shape (here: a different default CPU request) labels new pods apart."""
    from ddp_operator import pod as podmod
    job = make_job()
    before = template_hash(render_trainer_pod(job, 0, 0))
    monkeypatch.setattr(podmod, "DEFAULT_CPU_REQUEST", "20m")
    assert template_hash(render_trainer_pod(job, 0, 0)) != before
