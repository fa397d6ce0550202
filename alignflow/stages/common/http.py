"""What the stages' small HTTP servers share (`rm/server.py`, `rl/openai_server.py`)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def send_json(handler: BaseHTTPRequestHandler, status: int, payload: dict[str, Any]) -> None:
    """A JSON reply with its length, so a keep-alive client can reuse the connection."""
    data = json.dumps(payload).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class Server(ThreadingHTTPServer):
    """A thread per connection, and a listen backlog for many clients at once (the default 5 refuses the
    connections of the 6th and later concurrent episodes)."""

    request_queue_size = 1024
    daemon_threads = True
