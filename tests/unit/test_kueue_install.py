"""hack/kueue.py's pure parts (hack/kueue_values.py): the manager configuration it gives Kueue's chart and its Helm
post-renderer."""
from __future__ import annotations

import yaml

from hack import kueue_values

# A manager configuration shaped like the chart's default (an `integrations:` block with a `frameworks:` list,
# commented entries among them, and a commented example after it).
CHART_CONFIG = """apiVersion: config.kueue.x-k8s.io/v1beta2
kind: Configuration
webhook:
  port: 9443
integrations:
  frameworks:
  - "batch/job"
  - "kubeflow.org/mpijob"
#  - "sparkoperator.k8s.io/sparkapplication"
  - "pod"
  - "deployment"
#  externalFrameworks:
#  - "Foo.v1.example.com"
#fairSharing:
#  preemptionStrategies: [LessThanOrEqualToFinalShare]
"""


def test_manager_config_adds_ddpjob_and_keeps_only_the_jobs_integration(monkeypatch):
    monkeypatch.setattr(kueue_values, "chart_manager_config", lambda: CHART_CONFIG)
    config = yaml.safe_load(kueue_values.manager_config())
    assert config["integrations"] == {"externalFrameworks": ["DDPJob.v1alpha1.ddp.dev"], "frameworks": ["batch/job"]}
    assert config["webhook"] == {"port": 9443}  # the rest of the chart's configuration stays


def test_post_render_drops_only_the_api_services():
    rendered = ("---\napiVersion: v1\nkind: Service\nmetadata: {name: a}\n"
                "---\napiVersion: apiregistration.k8s.io/v1\nkind: APIService\nmetadata: {name: v1beta2.visibility}\n"
                "---\napiVersion: apps/v1\nkind: Deployment\nmetadata: {name: b}\n")
    kinds = [d["kind"] for d in yaml.safe_load_all(kueue_values.post_render(rendered)) if d]
    assert kinds == ["Service", "Deployment"]
