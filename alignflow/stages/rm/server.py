"""`alignflow reward-server`: a published reward model behind the remote-reward contract (`stages/rl/remote.py`),
so PPO/GRPO runs score with a reward model served elsewhere (on its own GPUs, or shared by several runs).

    POST /score  {"prompts", "completions", "prompt_ids", "completion_ids", "columns"} -> {"scores": [...]}
    GET  /health -> {"status": "ok", "model": <folder>}

A sample with token ids is scored on `prompt_ids + completion_ids`, exactly as an rl stage scores with a local
reward model (the generated ids, EOS included: no text round trip); one without (empty lists) on its text,
formatted as the rm stage trained. Scores are normalised with the rm stage's statistics unless
`--no-normalize`. A malformed request gets HTTP 400 naming what is wrong; with `--auth-env VAR` a request
without `Authorization: Bearer $VAR` gets 401. One model, so batches are scored one at a time.
"""

from __future__ import annotations

import hmac
import json
import os
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any

from alignflow.stages.common.http import Handler as JSONHandler, Server, send_json

FIELDS = ("prompts", "completions", "prompt_ids", "completion_ids")


class BadRequest(ValueError):
    pass


def parse_request(body: bytes) -> dict[str, list]:
    """The contract's fields, checked: equal lengths, ids lists of ints (or all empty: score the text)."""
    try:
        request = json.loads(body)
    except ValueError as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(request, dict) or not all(isinstance(request.get(f), list) for f in FIELDS[:2]):
        raise BadRequest(f"expected a JSON object with lists {', '.join(FIELDS)} (ids may be empty lists)")
    n = len(request["prompts"])
    fields = {f: request.get(f) or [] for f in FIELDS}
    for f, values in fields.items():
        if len(values) not in ((n,) if f in FIELDS[:2] else (0, n)):
            raise BadRequest(f"{f} has {len(values)} entries for {n} prompts")
    for f in FIELDS[2:]:
        for i, ids in enumerate(fields[f]):
            if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
                raise BadRequest(f"{f}[{i}] is not a list of token ids")
    if bool(fields["prompt_ids"]) != bool(fields["completion_ids"]):
        raise BadRequest("give both prompt_ids and completion_ids, or neither")
    return fields


class RewardService:
    def __init__(self, scorer, model: str, token: str | None):
        self.scorer, self.model, self.token, self.lock = scorer, model, token, threading.Lock()

    def score(self, fields: dict[str, list]) -> list[float]:
        vocab = self.scorer.model.config.vocab_size
        for ids in fields["prompt_ids"] + fields["completion_ids"]:  # another tokenizer's ids: the caller's mistake
            if any(not 0 <= t < vocab for t in ids):
                raise BadRequest(f"token id out of this model's vocabulary (size {vocab}): were the ids made with its tokenizer?")
        with self.lock:
            if fields["prompt_ids"]:
                scores = self.scorer.score_ids([p + c for p, c in zip(fields["prompt_ids"], fields["completion_ids"])])
            else:
                scores = self.scorer.score(fields["prompts"], fields["completions"])
        return [float(s) for s in scores]

    def authorized(self, header: str | None) -> bool:
        return self.token is None or hmac.compare_digest(header or "", f"Bearer {self.token}")

    def handler(self) -> type[BaseHTTPRequestHandler]:
        service = self

        class Handler(JSONHandler):
            def do_GET(self) -> None:
                if self.path != "/health":
                    return self._reply(404, {"error": f"no {self.path}: POST /score, GET /health"})
                self._reply(200, {"status": "ok", "model": service.model})

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != "/score":
                    return self._reply(404, {"error": f"no {self.path}: POST /score"})
                if not service.authorized(self.headers.get("Authorization")):
                    return self._reply(401, {"error": "missing or wrong bearer token"})
                try:
                    scores = service.score(parse_request(body))
                except BadRequest as exc:
                    return self._reply(400, {"error": str(exc)})
                except Exception as exc:  # the model's failure: the client retries 5xx
                    return self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})
                self._reply(200, {"scores": scores})

            def _reply(self, status: int, payload: dict[str, Any]) -> None:
                send_json(self, status, payload)

            def log_message(self, format: str, *args: Any) -> None:  # one line per request, headers never
                print(f"reward-server: {self.address_string()} {format % args}", flush=True)

        return Handler


def serve(model: str, host: str, port: int, normalize: bool, batch_size: int, auth_env: str | None) -> Server:
    """A started server (call `serve_forever`); `model` is a local reward-model folder."""
    from alignflow.stages.rm.scoring import RewardScorer

    token = os.environ.get(auth_env) if auth_env else None
    if auth_env and not token:
        raise ValueError(f"--auth-env {auth_env}: the environment variable is not set")
    service = RewardService(RewardScorer(model, normalize=normalize, batch_size=batch_size), model, token)
    return Server((host, port), service.handler())
