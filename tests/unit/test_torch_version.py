"""A torch outside the range ddp_trainer is tested with is refused at start, on both sides of the range, by the
launcher and by the ddpjob-c10d backend (one line, exit code 78), and the operator fails such a job at once with
reason UnsupportedTorch; the range is written once (trainer/ddp_trainer/requirements.txt) and agrees with the pins; the guide's
Dockerfile (docs/your-script.md) is the one the e2e test builds."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from ddp_operator import names
from ddp_operator.plan import plan
from ddp_trainer import launch, rendezvous, torch_version
from ddp_trainer.env import ALLOW_UNSUPPORTED_TORCH

from ddp_builders import NOW, later, make_job, observed, rdzv, trainer

REPO = Path(__file__).resolve().parents[2]
RANGE = torch_version.supported()
# Both sides of the range, as torch spells its versions (a local CUDA tag, a nightly, a patch release).
INSIDE = ["2.13.0", "2.13.0+cu130", "2.13.1", "2.13.2+cpu"]
OUTSIDE = ["2.12.1", "2.12.0+cu126", "2.14.0", "2.14.0a0+git1234", "3.0.0", "1.13.1", "nonsense"]


# --- the range ---------------------------------------------------------------------------------------------------
def test_the_range_is_the_one_written_beside_the_package():
    assert (RANGE.lowest, RANGE.below, RANGE.text) == ((2, 13), (2, 14), ">=2.13,<2.14")


def test_the_distribution_takes_its_dependencies_from_the_same_file():
    project = tomllib.loads((REPO / "trainer" / "pyproject.toml").read_text())
    assert "dependencies" in project["project"]["dynamic"] and "dependencies" not in project["project"]
    files = project["tool"]["setuptools"]["dynamic"]["dependencies"]["file"]
    assert [REPO / "trainer" / f for f in files] == [torch_version.REQUIREMENTS]
    assert "requirements.txt" in project["tool"]["setuptools"]["package-data"]["ddp_trainer"]


def test_the_pinned_torch_is_inside_the_range():
    """The image's pin (requirements-trainer.txt) and the tested version (hack/versions.env) are supported ones."""
    pin = re.search(r"^torch==(\S+)$", (REPO / "requirements-trainer.txt").read_text(), re.MULTILINE)
    tested = re.search(r"^TORCH_VERSION=(\S+)$", (REPO / "hack" / "versions.env").read_text(), re.MULTILINE)
    assert pin and tested
    assert RANGE.allows(pin.group(1)) and RANGE.allows(tested.group(1)), (pin.group(1), tested.group(1), RANGE)


@pytest.mark.parametrize("text", ["numpy\n", "torch>=2.13\n", "torch<2.14\n", "torch>=2.13,<=2.14\n",
                                  "torch~=2.13\n", "torch>=2.13,>=2.12,<2.14\n"])
def test_a_range_written_otherwise_is_an_error(text):
    with pytest.raises(ValueError):
        torch_version.parse_range(text)


# --- the refusal --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", INSIDE)
def test_a_torch_inside_the_range_passes(version):
    assert torch_version.refusal(version) is None
    torch_version.check(version)


@pytest.mark.parametrize("version", OUTSIDE)
def test_a_torch_outside_the_range_is_refused_with_what_to_do(version):
    with pytest.raises(torch_version.UnsupportedTorch) as e:
        torch_version.check(version)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{torch_version.MARKER} {version}:"), message
    assert RANGE.text in message and "pip install 'torch>=2.13,<2.14'" in message and ALLOW_UNSUPPORTED_TORCH in message


def test_the_installed_torch_is_read(monkeypatch):
    import torch

    monkeypatch.setattr(torch, "__version__", "2.12.1")
    assert torch_version.installed() == "2.12.1"
    with pytest.raises(torch_version.UnsupportedTorch):
        torch_version.check()


def test_the_launcher_refuses_before_it_patches_anything(monkeypatch, capsys):
    """python -m ddp_trainer.launch on torch 2.12: exit 78, the refusal as its last line, torchrun untouched."""
    from torch.distributed import run as torchrun

    monkeypatch.delenv(ALLOW_UNSUPPORTED_TORCH, raising=False)
    monkeypatch.setattr(torch_version, "installed", lambda: "2.12.1")
    before = torchrun.config_from_args
    with pytest.raises(SystemExit) as e:
        launch.main(["--standalone", "train.py"])
    assert e.value.code == torch_version.EXIT_CODE == 78
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"{torch_version.MARKER} 2.12.1:")
    assert torchrun.config_from_args is before


def test_the_rendezvous_backend_refuses_before_it_touches_torch(monkeypatch, capsys):
    monkeypatch.delenv(ALLOW_UNSUPPORTED_TORCH, raising=False)
    monkeypatch.setattr(torch_version, "installed", lambda: "2.14.0")
    with pytest.raises(SystemExit) as e:
        rendezvous.get_handler()(params=None)  # params are never read: the refusal comes first
    assert e.value.code == 78
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"{torch_version.MARKER} 2.14.0:")


def test_the_refusal_can_be_overridden_to_try_a_new_torch(monkeypatch, capsys):
    monkeypatch.setenv(ALLOW_UNSUPPORTED_TORCH, "1")
    torch_version.require("ddp_trainer.launch", "2.14.0")
    assert "2.14.0" in capsys.readouterr().err


def test_a_supported_torch_starts_silently(monkeypatch, capsys):
    monkeypatch.delenv(ALLOW_UNSUPPORTED_TORCH, raising=False)
    torch_version.require("ddp_trainer.launch", "2.13.0+cu130")
    assert capsys.readouterr().err == ""


# --- the operator ----------------------------------------------------------------------------------------------------
def _running():
    job = make_job(nodes=2)
    first = plan(job, {}, observed(service_exists=False), NOW)
    return job, plan(job, first.status, observed(rdzv(), trainer(0), trainer(1)), NOW).status


REFUSED = "[W] some earlier line\n" + torch_version.refusal("2.12.1")


@pytest.mark.parametrize("how", ["restarted in place", "pod ended"])
def test_the_operator_fails_a_job_whose_trainer_refused_its_torch_at_once(how):
    """Whatever the failure policy: a restart cannot change the image's torch."""
    job, status = _running()
    failing = (trainer(1, restart_count=1, last_exit_code=78, last_message=REFUSED) if how == "restarted in place"
               else trainer(1, phase="Failed", exit_code=78, message=REFUSED, restart_policy="Never"))
    p = plan(job, status, observed(rdzv(), trainer(0), failing), later(1))
    assert p.status["phase"] == "Failed" and p.status["reason"] == names.REASON_TORCH_UNSUPPORTED, p.status
    assert p.status["message"].startswith("pod mnist-1: ddp_trainer: unsupported torch 2.12.1:"), p.status["message"]
    assert ("Warning", names.REASON_TORCH_UNSUPPORTED) in [(e.type, e.reason) for e in p.events]
    assert p.status["lastFailure"]["reason"] == names.REASON_TORCH_UNSUPPORTED


def test_the_refusal_quoted_before_the_last_line_is_an_ordinary_failure():
    job, status = _running()
    quoted = REFUSED + "\nRuntimeError: something else"
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1, restart_count=1, last_exit_code=1,
                                                                  last_message=quoted)), later(1))
    assert p.status["phase"] != "Failed" and p.status["restarts"] == 1, p.status


# --- docs/your-script.md ---------------------------------------------------------------------------------------------
def test_the_e2e_user_image_is_the_dockerfile_the_guide_shows():
    """tests/e2e/test_e2e_user_image.py builds exactly the five lines docs/your-script.md tells users to write."""
    guide = (REPO / "docs" / "your-script.md").read_text()
    shown = re.search(r"```dockerfile\n(.*?)```", guide, re.DOTALL)
    assert shown, "docs/your-script.md shows no Dockerfile"
    built = (REPO / "tests" / "e2e" / "user_image" / "Dockerfile").read_text()
    assert shown.group(1).replace("<registry>/", "localhost/") == built
    assert len(built.splitlines()) == 5
