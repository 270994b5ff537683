"""progress.probe against a local HTTP server standing in for rank 0's /progress endpoint."""

import http.server
import json
import threading

from ddp_operator import names, progress


def test_probe_finds_the_pod_that_answers(monkeypatch):
    report = {"step": 7, "loss": 0.5}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = json.dumps(report).encode() if self.path == names.PROGRESS_PATH else b""
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(names, "PROGRESS_PORT", server.server_address[1])
    try:
        # 127.0.0.2 refuses (nothing listens there on that port); 127.0.0.1 is "rank 0".
        assert progress.probe(["127.0.0.2", "127.0.0.1"]) == ("127.0.0.1", report)
        assert progress.probe(["127.0.0.2"]) is None
    finally:
        server.shutdown()
