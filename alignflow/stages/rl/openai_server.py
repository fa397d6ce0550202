"""An OpenAI-compatible endpoint in front of the rollout engines: agents written with the `openai` client (or any
framework on top of it) talk to the policy being trained, and every call is recorded in token ids.

    GET  /v1/models
    POST /v1/chat/completions   messages, n, max_tokens, stop, stream (temperature, top_p: see below)
    POST /v1/completions        prompt (a string, or token ids), the same options

**Episode id: the API key.** An episode's client is `openai.OpenAI(base_url=<server>/v1, api_key=<episode id>)`;
every call made with that key is recorded under the episode: its prompt token ids (the chat template's
rendering of the messages, as the engine saw them), the sampled token ids and their log-probs, and the finish
reason. Training uses those ids, never a re-tokenisation of the text. A key that is not an open episode gets
HTTP 401; a model name other than the served one gets 404 naming the served name.

**Sampling.** While training, every call samples at the stage's `generation` settings (temperature, top_p, top_k)
whatever the request asks: the trainer's log-probs must be of the distribution the tokens were sampled from.
`max_tokens` is honoured up to `generation.max_new_tokens`; `n` and `stop` are honoured (a stop string ends the
text before it and the token ids at the token that completed it, so text and ids agree). During evaluation the
calls are greedy.

Concurrent requests are batched (`Batcher`): the first request waits `window_s` for others, then all that share
sampling settings go to the engines in one generate call.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable

from alignflow.stages.common.generation import Rollout, SamplingParams
from alignflow.stages.common.http import Handler as JSONHandler, Server, send_json

Generate = Callable[[list[list[int]], SamplingParams], list[Rollout]]


@dataclass
class Call:
    """One model call of an episode, as the engine ran it."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"


class EpisodeBook:
    """The calls of every open episode, by episode id (thread-safe)."""

    def __init__(self) -> None:
        self._calls: dict[str, list[Call]] = {}
        self._lock = threading.Lock()

    def open(self) -> str:
        episode = f"ep-{uuid.uuid4().hex}"
        with self._lock:
            self._calls[episode] = []
        return episode

    def is_open(self, episode: str) -> bool:
        with self._lock:
            return episode in self._calls

    def record(self, episode: str, calls: list[Call]) -> bool:
        """False if the episode was closed meanwhile (it timed out): its late calls are not trained on."""
        with self._lock:
            if episode not in self._calls:
                return False
            self._calls[episode] += calls
            return True

    def close(self, episode: str) -> list[Call]:
        with self._lock:
            return self._calls.pop(episode, [])


class Batcher:
    """Requests from many threads to few generate calls. Each generate call gets its own seed."""

    def __init__(self, generate: Generate, seed: int, window_s: float = 0.02, max_prompts: int = 512):
        self.generate, self.seed, self.window_s, self.max_prompts = generate, seed, window_s, max_prompts
        self._queue: list[tuple[list[int], SamplingParams, Future]] = []
        self._cv = threading.Condition()
        self._calls = 0
        self._stopped = False
        self.error: BaseException | None = None  # the first engine failure: the stage fails with it, not the agent
        self._thread = threading.Thread(target=self._loop, name="openai-batcher", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> list[Rollout]:
        future: Future = Future()
        with self._cv:
            self._queue.append((prompt_ids, params, future))
            self._cv.notify()
        return future.result()

    def reseed(self, seed: int) -> None:
        with self._cv:
            self.seed, self._calls = seed, 0

    def take_error(self) -> BaseException | None:
        with self._cv:
            error, self.error = self.error, None
        return error

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            waiting, self._queue = self._queue, []
            self._cv.notify()
        for _, _, future in waiting:
            future.set_exception(RuntimeError("the endpoint is closing"))

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
            time.sleep(self.window_s)  # let the other episodes' requests of this turn arrive
            with self._cv:
                batch, self._queue = self._queue[:self.max_prompts], self._queue[self.max_prompts:]
            groups: dict[SamplingParams, list[tuple[list[int], Future]]] = {}
            for prompt, params, future in batch:
                groups.setdefault(params, []).append((prompt, future))
            for params, items in groups.items():
                with self._cv:  # each engine call its own seed stream
                    seed, self._calls = self.seed + 1_000_003 * self._calls, self._calls + 1
                try:
                    out = self.generate([p for p, _ in items], replace(params, seed=seed))
                except BaseException as exc:  # every waiting request learns of it, and so does the stage
                    with self._cv:
                        self.error = self.error or exc
                    for _, future in items:
                        future.set_exception(exc)
                    continue
                for k, (_, future) in enumerate(items):
                    future.set_result(out[k * params.n:(k + 1) * params.n])


class RequestError(Exception):
    """An OpenAI-style error reply: HTTP status, message, type and code."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.code = status, type_, code


def stop_cut(tokenizer, ids: list[int], stops: list[str]) -> tuple[list[int], str, bool]:
    """(ids up to the token that completes the first stop string, the text before that string, whether one
    was found); without a stop string, (ids, their text, False)."""
    stops = [s for s in stops if s]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if not any(s in text for s in stops):
        return ids, text, False
    for k in range(1, len(ids) + 1):  # the first prefix whose own text holds a stop string: text and ids agree
        head = tokenizer.decode(ids[:k], skip_special_tokens=True)
        hits = [head.find(s) for s in stops if s in head]
        if hits:
            return ids[:k], head[:min(hits)], True
    return ids, text[:min(text.find(s) for s in stops if s in text)], True


def message_text(content: Any) -> str:
    """A message's content: a string, or OpenAI's list of parts (their text parts joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    if content is None:
        return ""
    raise RequestError(400, f"message content must be a string or a list of parts, got {type(content).__name__}")


class OpenAIServer:
    """The endpoint of one RL stage. `sampling` is what calls sample with (set by the executor per rollout:
    the stage's settings while training, greedy in evaluation)."""

    def __init__(self, tokenizer, generate: Generate, *, model_name: str, sampling: SamplingParams, host: str = "127.0.0.1",
                 port: int = 0, seed: int = 0, window_s: float = 0.02):
        self.tokenizer, self.model_name, self.sampling = tokenizer, model_name, sampling
        self.book = EpisodeBook()
        self.batcher = Batcher(generate, seed, window_s)
        self.httpd = Server((host, port), self._handler())
        self.url = f"http://{host}:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="openai-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.batcher.stop()

    # ------------------------------------------------------------------ requests

    def complete(self, episode: str, body: dict[str, Any], chat: bool) -> tuple[list[dict[str, Any]], dict[str, int]]:
        """The choices and usage of one request; its calls recorded under the episode."""
        if not self.book.is_open(episode):
            raise RequestError(401, "unknown or finished episode: the API key must be the episode id alignflow gave the agent",
                               "authentication_error", "invalid_api_key")
        if body.get("model") != self.model_name:
            raise RequestError(404, f"model {body.get('model')!r} is not served here: use {self.model_name!r}", code="model_not_found")
        prompt_ids = self._prompt_ids(body, chat)
        params = self._params(body)
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        rollouts = self.batcher.submit(prompt_ids, params)
        calls, choices = [], []
        for index, r in enumerate(rollouts):
            ids, text, stopped = stop_cut(self.tokenizer, r.response_ids, stops)
            finish = "stop" if stopped or r.finish_reason == "stop" else "length"
            calls.append(Call(prompt_ids, ids, r.logprobs[:len(ids)], finish))
            choices.append({"index": index, "finish_reason": finish, "logprobs": None,
                            **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})})
        if not self.book.record(episode, calls):
            raise RequestError(401, "the episode ended (timed out) before this call returned", "authentication_error")
        completion = sum(len(c.response_ids) for c in calls)
        return choices, {"prompt_tokens": len(prompt_ids), "completion_tokens": completion, "total_tokens": len(prompt_ids) + completion}

    def _prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RequestError(400, "messages must be a non-empty list", code="invalid_messages")
            turns = [{"role": m.get("role"), "content": message_text(m.get("content"))} for m in messages if isinstance(m, dict)]
            text = self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise RequestError(400, "prompt must be one string or one list of token ids", code="invalid_prompt")

    def _params(self, body: dict[str, Any]) -> SamplingParams:
        n, cap = body.get("n") or 1, self.sampling.max_new_tokens
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or cap
        if not (isinstance(n, int) and 1 <= n <= 16):
            raise RequestError(400, f"n must be an integer from 1 to 16, got {n!r}", code="invalid_n")
        if not (isinstance(max_tokens, int) and max_tokens >= 1):
            raise RequestError(400, f"max_tokens must be a positive integer, got {max_tokens!r}", code="invalid_max_tokens")
        return replace(self.sampling, n=n, max_new_tokens=min(max_tokens, cap), seed=0)

    # ------------------------------------------------------------------ HTTP

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(JSONHandler):
            def do_GET(self) -> None:
                if self.path.rstrip("/") != "/v1/models":
                    return self._error(RequestError(404, f"no GET {self.path}", code="not_found"))
                self._json(200, {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0, "owned_by": "alignflow"}]})

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                route = self.path.rstrip("/")
                if route not in ("/v1/chat/completions", "/v1/completions"):
                    return self._error(RequestError(404, f"no POST {self.path}", code="not_found"))
                try:
                    body = json.loads(raw)
                    if not isinstance(body, dict):
                        raise RequestError(400, "the body must be a JSON object")
                    episode = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
                    choices, usage = server.complete(episode, body, chat=route.endswith("chat/completions"))
                except json.JSONDecodeError as exc:
                    return self._error(RequestError(400, f"the body is not JSON: {exc}"))
                except RequestError as exc:
                    return self._error(exc)
                except Exception as exc:  # the engines failed: the client sees a server error, the stage the exception
                    return self._error(RequestError(500, f"{type(exc).__name__}: {exc}", "server_error"))
                chat = route.endswith("chat/completions")
                head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                        "model": server.model_name}
                if body.get("stream"):
                    return self._stream(head, choices, chat)
                self._json(200, {**head, "object": "chat.completion" if chat else "text_completion", "choices": choices, "usage": usage})

            def _stream(self, head: dict[str, Any], choices: list[dict[str, Any]], chat: bool) -> None:
                """Server-sent events: one chunk with each choice's whole text, one with its finish reason, [DONE]."""
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                kind = "chat.completion.chunk" if chat else "text_completion"
                for c in choices:
                    text = c["message"]["content"] if chat else c["text"]
                    first = {"delta": {"role": "assistant", "content": text}} if chat else {"text": text}
                    last = {"delta": {}} if chat else {"text": ""}
                    for part, finish in ((first, None), (last, c["finish_reason"])):
                        chunk = {**head, "object": kind, "choices": [{"index": c["index"], "logprobs": None, "finish_reason": finish, **part}]}
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

            def _error(self, exc: RequestError) -> None:
                self._json(exc.status, {"error": {"message": str(exc), "type": exc.type, "param": None, "code": exc.code}})

            def _json(self, status: int, payload: dict[str, Any]) -> None:
                send_json(self, status, payload)

            def log_message(self, *args: Any) -> None:  # thousands of calls per step: counted, not logged
                pass

        return Handler
