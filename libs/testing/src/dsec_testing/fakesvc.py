"""A stand-in DSec service for tests of the stack's service handling (never a product service).

It serves ``/healthz`` (``{"status": "ok", "service": FAKESVC_NAME, ...}``) and ``/metrics`` on
``DSEC_METRICS_PORT`` and exits with status 4 unless it received every ``DSEC_*`` endpoint.
``FAKESVC_MODE=crash`` makes it exit at once with status 3 (a service that fails to start).
At SIGTERM it writes ``$DSEC_HOME/run/<name>.stopped``: whether ``dsec down`` asked services to
stop their sandboxes (``stop sandboxes``) or not (``keep sandboxes``).

Run it as ``python -m dsec_testing.fakesvc`` (``ServiceSpec("x", module="dsec_testing.fakesvc")``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REQUIRED = (
    "DSEC_HOME",
    "DSEC_NATS_URL",
    "DSEC_POSTGRES_DSN",
    "DSEC_S3_ENDPOINT",
    "DSEC_S3_ACCESS_KEY",
    "DSEC_S3_SECRET_KEY",
    "DSEC_VAULT_ADDR",
    "DSEC_VAULT_TOKEN",
    "DSEC_METRICS_PORT",
)


def main() -> None:
    """Serve until SIGTERM."""
    if os.environ.get("FAKESVC_MODE") == "crash":
        print("fakesvc: crashing on purpose (FAKESVC_MODE=crash)", file=sys.stderr)
        sys.exit(3)
    missing = [k for k in REQUIRED if not os.environ.get(k)]
    if missing:
        print(f"fakesvc: missing {missing}", file=sys.stderr)
        sys.exit(4)
    name = os.environ.get("FAKESVC_NAME", "fakesvc")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/healthz":
                body = json.dumps({"status": "ok", "service": name, "version": "0.0.1"}).encode()
                ctype = "application/json"
            elif self.path == "/metrics":
                body = b"fakesvc_up 1\n"
                ctype = "text/plain; version=0.0.4"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", int(os.environ["DSEC_METRICS_PORT"])), Handler)

    def stop(*_: object) -> None:
        # What a node agent would learn at SIGTERM: does `dsec down` want sandboxes stopped?
        run = os.path.join(os.environ["DSEC_HOME"], "run")
        asked = os.path.exists(os.path.join(run, "stack-down"))
        with open(os.path.join(run, f"{name}.stopped"), "w") as fh:
            fh.write("stop sandboxes" if asked else "keep sandboxes")
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    print(f"fakesvc: serving on {server.server_address}", file=sys.stderr)
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
