"""`python -m ddp_store`: serve the rendezvous store until SIGTERM (exit status 0).

    python -m ddp_store [--port PORT] [--host HOST]

The port comes from --port, else DDPJOB_RDZV_PORT (the operator sets it in the `<job>-rdzv` pod: spec.torchrun.rdzvPort),
else 29400; the host from --host, else every address of the pod. One structured line at the start
(`event=listening port=...`) and one at the end (`event=stopped ...`).
"""

from __future__ import annotations

import argparse
import os
import sys

from ddp_store import __version__
from ddp_store.server import Server, log_line

ENV_PORT = "DDPJOB_RDZV_PORT"  # the operator's names.ENV_RDZV_PORT (tests/unit/test_contract.py)
DEFAULT_PORT = 29400


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddp_store",
                                description="A DDPJob's rendezvous store: torch's TCPStore protocol, without torch.")
    p.add_argument("--port", type=int, default=None,
                   help=f"TCP port (default: ${ENV_PORT}, else {DEFAULT_PORT}; 0: any free port)")
    p.add_argument("--host", default=None, help="address to listen on (default: all, IPv6 and IPv4)")
    p.add_argument("--version", action="version", version=f"ddp_store {__version__}")
    args = p.parse_args(argv)
    if args.port is None:
        raw = os.environ.get(ENV_PORT, str(DEFAULT_PORT))
        try:
            args.port = int(raw)
        except ValueError:
            p.error(f"{ENV_PORT}={raw!r} is not a port number")
    if not 0 <= args.port <= 65535:
        p.error(f"port {args.port} is outside 0-65535")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        server = Server(args.host, args.port)
    except OSError as e:
        log_line("failed", stream=sys.stderr, port=args.port, error=f'"{e}"')
        return 1
    server.serve(signals=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
