"""A serve for fault tests whose health a test steers from outside (standard library only).

    python3 healthserve.py --port P [--delay S] [--control DIR]

`GET /health` answers 200 after `--delay` seconds. Files in the control directory change that
while it runs: `sick` (answer 503), `hang` (never answer: the client's timeout ends it), `exit`
(the process exits 0 at the next request). Run as a serve's `command` in the sandbox.
"""

from __future__ import annotations

import argparse
import http.server
import os
import sys
import threading
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--control", type=Path, default=None)
    # gpud's command placeholders are passed by tests that reuse standin-shaped commands
    p.add_argument("--gpu-memory-utilization", default=None)
    opts = p.parse_args()
    control: Path | None = opts.control
    forever = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            if control is not None and (control / "exit").exists():
                os._exit(0)
            if control is not None and (control / "hang").exists():
                forever.wait()
            if opts.delay:
                time.sleep(opts.delay)
            status = 503 if control is not None and (control / "sick").exists() else 200
            body = b"{}"
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", opts.port), Handler)
    server.daemon_threads = True
    print(f"healthserve listening on 127.0.0.1:{opts.port}", file=sys.stderr, flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
