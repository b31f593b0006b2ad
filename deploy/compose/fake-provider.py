#!/usr/bin/env python3
"""A stand-in provider for local runs: answers POSTs like a real provider.

    python3 fake-provider.py [--host 0.0.0.0] [--port 8080]

The job's payload (the request body) may choose the answer with "mode":
  (absent) or "ok"  200
  "reject"          400 (tollgate dead-letters the job as `rejected`)
  "flaky"           per Idempotency-Key: first call 429 (Retry-After: 1),
                    second call 500, then 200 — one of each outcome
  "fail"            500 every time (retried, then `exhausted`)

Used by deploy/compose/compose.yaml and by scripts/ops-check.sh. Standard
library only.
"""

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

calls: dict[str, int] = {}
lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            mode = json.loads(body or b"{}").get("mode", "ok")
        except (ValueError, AttributeError):
            mode = "ok"
        key = self.headers.get("Idempotency-Key", "")
        with lock:
            calls[key] = n = calls.get(key, 0) + 1
        status, headers = 200, {}
        if mode == "reject":
            status = 400
        elif mode == "fail":
            status = 500
        elif mode == "flaky" and n == 1:
            status, headers = 429, {"Retry-After": "1"}
        elif mode == "flaky" and n == 2:
            status = 500
        out = json.dumps({"status": status}).encode()
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self):  # health
        self.send_response(200)
        self.send_header("Content-Length", "3")
        self.end_headers()
        self.wfile.write(b"ok\n")

    def log_message(self, *args):
        pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=8080)
    args = ap.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"fake provider on {args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
