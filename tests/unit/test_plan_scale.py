"""What a pass costs as a job grows (issue 28): the planner renders only the children it creates, so a pass over a
whole job of N pods renders none, and its time does not carry a template copy per existing pod."""

from __future__ import annotations

import pytest
from ddp_builders import NOW, make_job, observed, rdzv, trainer

from ddp_operator import pod as podmod
from ddp_operator import rdzv as rdzvmod
from ddp_operator.plan import CREATE, children, plan
from ddp_operator.pod_hash import with_template_hash


@pytest.fixture
def renders(monkeypatch):
    """How many trainer and store pods the planner rendered."""
    count = {"trainer": 0, "rdzv": 0}
    real_trainer, real_rdzv = podmod.render_trainer_pod, rdzvmod.render_rdzv_pod

    def trainer_(*a, **kw):
        count["trainer"] += 1
        return real_trainer(*a, **kw)

    def rdzv_(*a, **kw):
        count["rdzv"] += 1
        return real_rdzv(*a, **kw)
    monkeypatch.setattr(children, "render_trainer_pod", trainer_)
    monkeypatch.setattr(children, "render_rdzv_pod", rdzv_)
    return count


def test_a_pass_over_a_whole_job_renders_no_pod(renders):
    job = make_job(nodes=1000)
    pods = observed(*[trainer(i) for i in range(1000)], rdzv())
    first = plan(job, {}, pods, NOW)
    renders.update(trainer=0, rdzv=0)
    again = plan(job, first.status, pods, NOW)
    assert not [a for a in again.actions if a.verb == CREATE and a.kind == "Pod"]
    assert renders == {"trainer": 0, "rdzv": 0}


def test_only_the_missing_pods_are_rendered_and_created(renders):
    job = make_job(nodes=100)
    present = [trainer(i) for i in range(100) if i % 10]  # 10 missing, and the store
    result = plan(job, {}, observed(*present), NOW)
    created = sorted(a.name for a in result.actions if a.verb == CREATE and a.kind == "Pod")
    assert created == sorted([f"mnist-{i}" for i in range(0, 100, 10)] + ["mnist-rdzv"])
    assert renders == {"trainer": 10, "rdzv": 1}
    bodies = {a.name: a.body for a in result.actions if a.verb == CREATE and a.kind == "Pod"}
    assert bodies["mnist-30"] == with_template_hash(podmod.render_trainer_pod(job, 30, 0))
