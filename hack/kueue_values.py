"""Kueue's Helm release as hack/kueue.py installs it, as text and data: where the pinned version's build, chart and
image are, the chart's manager configuration with DDPJob added as an external framework and FRAMEWORKS as the only
integrations, the release's values, and Helm's post-renderer that drops the visibility APIServices (hack/kueue.py's
docstring says why). No cluster, no Helm, no subprocess: reading the chart's values.yaml from the build cache is
the only I/O.

Standard library only, like hack/common.py, whose paths and pinned versions it uses.
"""
from __future__ import annotations

import re
from pathlib import Path

from hack import common

# The integrations Kueue runs here: batch/v1 Jobs (and DDPJobs, as an external framework). The chart's default
# also has pod, deployment, statefulset and others, whose webhooks (failurePolicy Fail for pods) would sit in
# the path of every pod created in the cluster, DDPJob pods included; leaving them out keeps a Kueue hiccup
# from blocking pod creation anywhere.
FRAMEWORKS = ["batch/job"]
IMAGE_REPO = "localhost/kueue"
# Kind.version.group of the DDPJob CRD (operator/ddp_operator/crd.py)
DDPJOB_FRAMEWORK = "DDPJob.v1alpha1.ddp.dev"
# Off, with its APIServices dropped (see hack/kueue.py's docstring): Kueue's on-demand visibility API.
FEATURE_GATES = [{"name": "VisibilityOnDemand", "enabled": False}]


class KueueError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------
# where things are

def version() -> str:
    return common.versions()["KUEUE_VERSION"]


def build_dir() -> Path:
    return common.CACHE / f"kueue-{version()}"


def chart_dir() -> Path:
    return build_dir() / "chart"


def image_ref() -> str:
    return f"{IMAGE_REPO}:{version()}"


# --------------------------------------------------------------------------------------------
# Helm values

def chart_manager_config() -> str:
    """The chart's default managerConfig.controllerManagerConfigYaml (a block scalar in its values.yaml)."""
    lines = (chart_dir() / "values.yaml").read_text().splitlines()
    start = lines.index("  controllerManagerConfigYaml: |-") + 1
    block = []
    for line in lines[start:]:
        if line.strip() and not line.startswith("    "):
            break
        block.append(line[4:])
    return "\n".join(block).rstrip() + "\n"


def manager_config() -> str:
    """The chart's manager configuration with DDPJob as an external framework and FRAMEWORKS as the
    integrations. The chart parses this text (fromYaml), so editing the lines of its `integrations:` block
    is enough; the Kueue manager validates the result when it starts."""
    text = chart_manager_config()
    lines = text.splitlines()
    if (lines.count("integrations:") != 1 or lines.count("  frameworks:") != 1
            or any(ln.lstrip().startswith("externalFrameworks:") for ln in lines)):
        raise KueueError("the chart's manager configuration has no single `integrations:` block with one "
                         f"`frameworks:` list (or already sets externalFrameworks): check {chart_dir() / 'values.yaml'}")
    at = lines.index("  frameworks:") + 1
    end = at
    while end < len(lines) and re.match(r"^#?\s*- ", lines[end]):
        end += 1
    lines[at:end] = [f'  - "{f}"' for f in FRAMEWORKS]
    at = lines.index("integrations:") + 1
    lines[at:at] = ["  externalFrameworks:", f'  - "{DDPJOB_FRAMEWORK}"']
    return "\n".join(lines) + "\n"


def post_render(manifests: str) -> str:
    """Helm's post-renderer: the rendered release without its APIService objects (hack/kueue.py's docstring says
    why)."""
    docs = re.split(r"(?m)^---[ \t]*$", manifests)
    return "---".join(d for d in docs if not re.search(r"(?m)^kind:[ \t]*APIService[ \t]*$", d))


def values(image_digest: str) -> dict:
    return {
        "enableCertManager": False,  # Kueue's internal certificate management (the chart's default)
        "enablePrometheus": False,
        "enableKueueViz": False,
        "enableVisibilityAPF": False,
        "controllerManager": {
            "replicas": 1,
            "featureGates": FEATURE_GATES,
            "manager": {
                "image": {"repository": IMAGE_REPO, "tag": version(), "pullPolicy": "Never"},
                # The tag stays the same across local rebuilds: the digest rolls the pod when it changed.
                "podAnnotations": {"ddp.dev/kueue-image": image_digest},
                "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                              "limits": {"cpu": "1", "memory": "512Mi"}},
            },
        },
        "managerConfig": {"controllerManagerConfigYaml": manager_config()},
    }
