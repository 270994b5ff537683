"""hack/docker-capshim: only the capabilities the host lacks leave a container's spec, then runc runs with
the same arguments (create/run through the bundle's config.json, exec through --process)."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json

import pytest

from tests import tools

ALL = ["CAP_CHOWN", "CAP_NET_ADMIN", "CAP_SYS_ADMIN", "CAP_SYS_RESOURCE"]
SETS = ["bounding", "effective", "permitted"]


@pytest.fixture
def shim(monkeypatch):
    path = str(tools.REPO_ROOT / "hack" / "docker-capshim")
    loader = importlib.machinery.SourceFileLoader("docker_capshim", path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("docker_capshim", loader))
    loader.exec_module(module)
    monkeypatch.setattr(module, "missing_caps", lambda: {"CAP_SYS_RESOURCE"})
    execs = []
    monkeypatch.setattr(module.os, "execvp", lambda file, argv: execs.append(argv))
    module.execs = execs
    return module


def run(shim, monkeypatch, *args: str) -> list[str]:
    monkeypatch.setattr(shim.sys, "argv", ["docker-capshim", *args])
    shim.main()
    return shim.execs[-1]


def caps(process: dict) -> dict:
    return {kind: list(ALL) for kind in SETS} | process


@pytest.mark.parametrize("command", ["create", "run"])
def test_bundle_spec_loses_only_the_missing_capabilities(shim, monkeypatch, tmp_path, command):
    (tmp_path / "config.json").write_text(json.dumps({"process": {"capabilities": caps({})}, "root": {}}))
    argv = run(shim, monkeypatch, "--root", "/run/x", "--log-format", "json", command, "--bundle", str(tmp_path),
               "abc")
    spec = json.loads((tmp_path / "config.json").read_text())
    assert spec["process"]["capabilities"] == {k: ["CAP_CHOWN", "CAP_NET_ADMIN", "CAP_SYS_ADMIN"] for k in SETS}
    assert spec["root"] == {}
    assert argv == ["runc", "--root", "/run/x", "--log-format", "json", command, "--bundle", str(tmp_path), "abc"]


def test_exec_process_file_is_rewritten(shim, monkeypatch, tmp_path):
    process = tmp_path / "process.json"
    process.write_text(json.dumps({"args": ["sh"], "capabilities": caps({})}))
    run(shim, monkeypatch, "exec", f"--process={process}", "--detach", "abc")
    assert json.loads(process.read_text())["capabilities"]["effective"] == ["CAP_CHOWN", "CAP_NET_ADMIN",
                                                                            "CAP_SYS_ADMIN"]


def test_other_commands_pass_through_untouched(shim, monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"process": {"capabilities": caps({})}}))
    before = (tmp_path / "config.json").read_text()
    assert run(shim, monkeypatch, "delete", "--force", "abc") == ["runc", "delete", "--force", "abc"]
    assert (tmp_path / "config.json").read_text() == before


def test_spec_without_missing_capabilities_is_not_rewritten(shim, monkeypatch, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"process": {"capabilities": {"bounding": ["CAP_CHOWN"]}}}))
    mtime = config.stat().st_mtime_ns
    run(shim, monkeypatch, "create", "-b", str(tmp_path), "abc")
    assert config.stat().st_mtime_ns == mtime
