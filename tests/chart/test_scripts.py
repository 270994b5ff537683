"""The shipping scripts: shellcheck-clean, and the demo job derived from the digits sample."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil

import pytest

from tests import tools
from tests.chart.conftest import run

SCRIPTS = ["hack/build-images.sh", "hack/demo.sh", "hack/kind-e2e.sh", "hack/install-deps.sh", "hack/test.sh"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_is_shellcheck_clean(script):
    run(["bash", "-n", script], cwd=tools.REPO_ROOT)
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        # hack/install-deps.sh installs it, so CI (CI=true) always lints; elsewhere a hint is enough.
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("shellcheck is not installed; hack/install-deps.sh installs it", pytrace=False)
        pytest.skip("shellcheck is not installed (hack/install-deps.sh or apt-get install shellcheck)")
    run([shellcheck, "-x", script], cwd=tools.REPO_ROOT)


def test_demo_job_is_the_digits_sample_slowed_down():
    spec = importlib.util.spec_from_file_location("demo", tools.REPO_ROOT / "hack" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    d = object.__new__(demo.Demo)  # no cluster needed to build the manifest
    d.a = argparse.Namespace(step_delay=0.25)
    d.ns, d.name = "ddp-demo", "digits"
    job = d.manifest()
    assert job["metadata"] == {"name": "digits", "namespace": "ddp-demo"}
    assert job["spec"]["nodes"] == 2
    trainer = job["spec"]["template"]["spec"]["containers"][0]
    assert trainer["command"] == ["python", "-m", "ddp_trainer.launch", "-m", "ddp_trainer.examples.digits"]
    env = {e["name"]: e["value"] for e in trainer["env"]}
    assert env == {"DIGITS_STEP_DELAY": "0.25", "DIGITS_PATIENCE": "0"}
