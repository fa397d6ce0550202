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


class Handler(BaseHTTPRequestHandler):
    """Keep-alive (a client reuses its connections), and TCP_NODELAY: a reply's headers and body are separate
    writes, and with Nagle's algorithm the body waited for the client's delayed ACK, 40 ms a call."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True


class Server(ThreadingHTTPServer):
    """A thread per connection, and a listen backlog for many clients at once (the default 5 refuses the
    connections of the 6th and later concurrent episodes)."""

    request_queue_size = 1024
    daemon_threads = True
