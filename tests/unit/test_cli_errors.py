"""`kubectl ddp` on bad input (issue: each a one-line error, a non-zero exit, nothing created): a missing script, a
script over the ConfigMap limit, an unknown job, no cluster reachable. The plugin runs whole (`main`, the real
kubernetes client) against a stand-in API server on loopback that records every request, so "nothing created" is
the absence of a write, not an assumption."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import urllib3

from ddp_operator import names
from kubectl_ddp import run
from kubectl_ddp.main import main

NS = "ml"


class _Api(BaseHTTPRequestHandler):
    """No DDPJob exists; a POST is answered as created (with a uid), and recorded like every request."""

    requests: list[tuple[str, str, dict | None]] = []

    def _answer(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.requests.append(("GET", self.path, None))
        name = self.path.split("?")[0].rstrip("/").rsplit("/", 1)[-1]
        self._answer(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                           "code": 404, "message": f'{names.CRD_NAME} "{name}" not found'})

    def _write(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        self.requests.append((self.command, self.path, body))
        body.setdefault("metadata", {})["uid"] = "uid-1"
        self._answer(201 if self.command == "POST" else 200, body)

    do_POST = do_PATCH = do_PUT = do_DELETE = _write  # noqa: N815

    def log_message(self, *args) -> None:
        pass


def _kubeconfig(tmp_path: Path, server: str) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": NS}}],
        "users": [{"name": "u", "user": {"token": "t"}}]}))
    return str(path)


def ddp(kubeconfig: str, command: str, *args: str) -> int:
    """`kubectl ddp COMMAND --kubeconfig K ARGS...` (the client reads $KUBECONFIG once, when first imported)."""
    return main([command, "--kubeconfig", kubeconfig, *args])


@pytest.fixture
def api(tmp_path):
    """The stand-in API server: (the requests it received, a kubeconfig that points at it)."""
    _Api.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield _Api.requests, _kubeconfig(tmp_path, f"http://127.0.0.1:{server.server_port}")
    server.shutdown()
    server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line_error(capsys, code: int) -> str:
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), (code, out.err)
    assert "Traceback" not in out.err + out.out
    return lines[0]


def _writes(requests) -> list:
    return [r[:2] for r in requests if r[0] != "GET"]


def test_a_missing_script_is_one_line_and_asks_nothing_of_the_cluster(api, tmp_path, capsys):
    requests, kubeconfig = api
    line = _one_line_error(capsys, ddp(kubeconfig, "run", str(tmp_path / "nope.py"), "--nodes", "2"))
    assert line.endswith("nope.py: no such file or directory")
    assert requests == []


def test_a_script_over_the_configmap_limit_says_to_bake_an_image_and_creates_nothing(api, tmp_path, capsys):
    (tmp_path / "train.py").write_text("pass\n")
    (tmp_path / "data.bin").write_bytes(b"\0" * run.MAX_SCRIPT_BYTES)
    requests, kubeconfig = api
    line = _one_line_error(capsys, ddp(kubeconfig, "run", str(tmp_path), "--entry", "train.py", "--nodes", "2"))
    assert "bake the code into an image" in line and "--in-image" in line
    assert _writes(requests) == []


@pytest.mark.parametrize("command", [["top", "nope", "--once"], ["top", "nope", "-o", "json"], ["logs", "nope"],
                                     ["logs", "nope", "-f"], ["describe", "nope"], ["plot", "nope"],
                                     ["plot", "nope", "-o", "x.png"]])
def test_an_unknown_job_is_kubectls_not_found(api, capsys, command):
    requests, kubeconfig = api
    line = _one_line_error(capsys, ddp(kubeconfig, *command))
    assert line == f'error: Error from server (NotFound): {names.CRD_NAME} "nope" not found'
    assert requests and _writes(requests) == []


@pytest.mark.parametrize("command", [["run", "train.py", "--nodes", "2"], ["top", "--once"], ["top", "j", "--once"],
                                     ["logs", "j", "-f"], ["describe", "j"], ["plot", "j"]])
def test_no_cluster_reachable_is_one_line(tmp_path, monkeypatch, capsys, command):
    (tmp_path / "train.py").write_text("pass\n")
    monkeypatch.chdir(tmp_path)
    server = f"http://127.0.0.1:{_closed_port()}"
    line = _one_line_error(capsys, ddp(_kubeconfig(tmp_path, server), *command))
    assert line.startswith(f"error: Unable to connect to the server {server}: ") and "refused" in line, line


def test_no_kubeconfig_is_one_line(tmp_path, capsys):
    assert "no usable kubeconfig" in _one_line_error(capsys, ddp(str(tmp_path / "absent"), "top", "--once"))


def test_code_baked_into_an_image_uploads_nothing(api, capsys):
    requests, kubeconfig = api
    assert ddp(kubeconfig, "run", "/app/train.py", "--in-image", "--image", "me/train:1", "--nodes", "2", "--name",
               "baked", "-d", "--", "--epochs", "3") == 0
    assert "ddpjob.ddp.dev/baked created" in capsys.readouterr().out
    (method, path, body), = [r for r in requests if r[0] != "GET"]
    assert method == "POST" and path.endswith(f"/namespaces/{NS}/{names.PLURAL}")
    trainer = body["spec"]["template"]["spec"]["containers"][0]
    assert trainer["image"] == "me/train:1" and trainer["command"] == ["torchrun", "/app/train.py", "--epochs", "3"]
    assert "workingDir" not in trainer  # the image's own
    assert [v["name"] for v in body["spec"]["template"]["spec"]["volumes"]] == ["tmp"]


@pytest.mark.parametrize("flags", [["--nodes", "0"], ["--nodes", "two"], ["--spares", "-1"],
                                   ["--nproc-per-node", "many"], ["--nproc-per-node", "0"]])
def test_bad_numbers_are_refused_before_anything_is_asked(api, tmp_path, capsys, flags):
    requests, kubeconfig = api
    (tmp_path / "train.py").write_text("pass\n")
    with pytest.raises(SystemExit) as exit_:
        ddp(kubeconfig, "run", str(tmp_path / "train.py"), *flags)
    assert exit_.value.code == 2 and requests == []
    assert capsys.readouterr().err.splitlines()[-1].startswith("kubectl ddp run: error: argument ")


def test_run_keeps_following_while_the_api_server_is_away(capsys):
    """A lost API server is said once and waited out: the exit status stays the job's result."""
    from rich.console import Console

    class Kube:
        namespace = NS
        api = type("Api", (), {"configuration": type("Conf", (), {"host": "https://10.0.0.1:6443"})()})()
        answers = [urllib3.exceptions.MaxRetryError(None, "/", urllib3.exceptions.NewConnectionError(
            None, "HTTPSConnection(host='10.0.0.1', port=6443): Failed to establish a new connection: [Errno 111] "
                  "Connection refused"))] * 2 + [{"status": {"phase": "Succeeded"}}]

        def job(self, name):
            answer = self.answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

        def pods(self, name):
            return []

    console = Console(record=True, width=200, force_terminal=False)
    run_poll, run.POLL_SECONDS = run.POLL_SECONDS, 0.0
    try:
        assert run.follow(Kube(), "j", console) == 0
    finally:
        run.POLL_SECONDS = run_poll
    text = console.export_text()
    assert text.count("Unable to connect to the server https://10.0.0.1:6443: Failed to establish a new connection: "
                      "[Errno 111] Connection refused (retrying)") == 1, text
    assert "> Succeeded" in text
