"""Tiny actions the cluster tests run inside pods (stdlib only).

    probe.py exit N                  print a line, exit with status N
    probe.py serve PORT              accept TCP connections forever, answering "pong"
    probe.py connect HOST PORT [S]   resolve HOST, connect, expect "pong"; retry for S seconds (default 60)
    probe.py api-list-pods NS        list pods in NS with the pod's service account (in-cluster config);
                                     prints the HTTP status and exits 0 on 200, 3 on 403, 1 otherwise
    probe.py api-get PATH            GET an API path the same way, print the status
    probe.py sleep                   sleep until killed
"""
import json
import os
import socket
import ssl
import sys
import time
import urllib.error
import urllib.request

SA = "/var/run/secrets/kubernetes.io/serviceaccount"


def api(path):
    host = os.environ["KUBERNETES_SERVICE_HOST"]  # the ClusterIP of `kubernetes`, reached via kube-proxy
    port = os.environ["KUBERNETES_SERVICE_PORT"]
    ctx = ssl.create_default_context(cafile=f"{SA}/ca.crt")
    token = open(f"{SA}/token").read().strip()
    req = urllib.request.Request(f"https://{host}:{port}{path}", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def main(argv):
    cmd = argv[0]
    if cmd == "exit":
        print(f"probe {os.environ.get('PROBE_VERSION')} on {socket.gethostname()}: exiting {argv[1]}")
        return int(argv[1])
    if cmd == "serve":
        srv = socket.create_server(("", int(argv[1])))
        print(f"listening on {argv[1]}", flush=True)
        while True:
            conn, peer = srv.accept()
            print(f"connection from {peer[0]}", flush=True)
            conn.sendall(b"pong\n")
            conn.close()
    if cmd == "connect":
        host, port = argv[1], int(argv[2])
        deadline = time.monotonic() + (float(argv[3]) if len(argv) > 3 else 60)
        while True:
            try:
                addr = socket.gethostbyname(host)
                with socket.create_connection((addr, port), timeout=3) as s:
                    reply = s.recv(16).decode().strip()
                print(f"{host} -> {addr}:{port} said {reply}")
                return 0 if reply == "pong" else 1
            except OSError as e:
                if time.monotonic() > deadline:
                    print(f"{host}:{port}: {e}")
                    return 1
                time.sleep(1)
    if cmd == "api-list-pods":
        status, body = api(f"/api/v1/namespaces/{argv[1]}/pods")
        names = [p["metadata"]["name"] for p in body.get("items", [])]
        print(json.dumps({"status": status, "pods": names, "message": body.get("message")}))
        return {200: 0, 403: 3}.get(status, 1)
    if cmd == "api-get":
        status, body = api(argv[1])
        print(json.dumps({"status": status, "message": body.get("message")}))
        return {200: 0, 403: 3}.get(status, 1)
    if cmd == "sleep":
        while True:
            time.sleep(3600)
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
