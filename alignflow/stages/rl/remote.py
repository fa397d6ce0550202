"""Remote rewards: a reward service over HTTP (a reward-model server, a code sandbox, a judge).

`reward.url: http://host:port/score` in an rl stage posts the samples in batches and reads back one
score per sample. The contract (what `alignflow reward-server` serves):

    POST {url}   Content-Type: application/json   [Authorization: Bearer $<reward.http.auth_env>]
    {"prompts": [str], "completions": [str], "prompt_ids": [[int]], "completion_ids": [[int]],
     "columns": {"answer": [...], ...}}              # the prompt rows' other columns, one value per sample
    -> 200 {"scores": [float]}                        # one finite number per sample, in order

It is the reward-function contract (`rewards.py`) as JSON. Before any worker starts, the stage posts an
empty batch (expecting `{"scores": []}`), so a wrong URL fails in seconds, not after the model loads.

Failures, and what they mean to the pipeline:
- a refused connection, a timeout, HTTP 5xx, 408 or 429: retried with exponential backoff; past
  `reward.http.retries` the stage fails with `ServiceUnavailable` (exit code `SERVICE_UNAVAILABLE`,
  which Prefect's task retry retries: an outage is not bad input);
- any other HTTP 4xx, a reply that is not `{"scores": [...]}` of the right length, or a non-finite score:
  `RewardError`, bad input, naming the URL and the status or the sample (not retried).
The auth header's value is read from the environment and never logged or put in an error.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class ServiceUnavailable(RuntimeError):
    """A service the stage depends on stayed unreachable past its retries: the stage fails, and is retried."""


def _jsonable(value: Any) -> Any:
    """numpy scalars and arrays from a Parquet row as JSON values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)  # dates, decimals: as text rather than a crash in the middle of a step


class RemoteReward:
    """Called like `FunctionReward`: (prompts, completions, prompt_ids, completion_ids, columns) -> (N,) scores."""

    def __init__(self, url: str, *, timeout_s: float, retries: int, backoff_s: float, batch_size: int, concurrency: int,
                 auth_env: str | None):
        from alignflow.stages.rl.rewards import RewardError

        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s
        self.batch_size, self.concurrency = batch_size, concurrency
        self.headers = {"Content-Type": "application/json"}
        if auth_env:
            token = os.environ.get(auth_env)
            if not token:
                raise RewardError(f"reward.http.auth_env={auth_env}: the environment variable is not set (it holds the "
                                  f"bearer token for {url})")
            self.headers["Authorization"] = f"Bearer {token}"
        self.client = httpx.Client(timeout=timeout_s, headers=self.headers,
                                   limits=httpx.Limits(max_connections=concurrency))

    def check(self) -> None:
        """An empty batch: the service is up and speaks the contract (before any worker starts)."""
        self._post({"prompts": [], "completions": [], "prompt_ids": [], "completion_ids": [], "columns": {}}, [], [])

    def __call__(self, prompts: list[str], completions: list[str], prompt_ids: list[list[int]],
                 completion_ids: list[list[int]], columns: dict[str, list[Any]]):
        import torch

        cuts = [slice(k, k + self.batch_size) for k in range(0, len(prompts), self.batch_size)]
        bodies = [{"prompts": prompts[c], "completions": completions[c], "prompt_ids": prompt_ids[c],
                   "completion_ids": completion_ids[c], "columns": {k: v[c] for k, v in columns.items()}} for c in cuts]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, max(len(bodies), 1))) as pool:
            parts = list(pool.map(lambda b: self._post(b, b["prompts"], b["completions"]), bodies))
        return torch.cat(parts) if parts else torch.zeros(0)

    def _post(self, body: dict[str, Any], prompts: list[str], completions: list[str]):
        from alignflow.stages.rl.rewards import RewardError, checked_scores

        payload = json.dumps(body, default=_jsonable).encode()
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), 30.0))
            try:
                reply = self.client.post(self.url, content=payload)
            except httpx.TimeoutException:
                problem = f"no reply within {self.timeout_s:g} s"
                continue
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
                continue
            if reply.status_code in RETRYABLE_STATUS:
                problem = f"HTTP {reply.status_code}: {reply.text[:200]!r}"
                continue
            if reply.status_code != 200:
                raise RewardError(f"reward service {self.url} answered HTTP {reply.status_code} (not retried: the request "
                                  f"is refused, not the service down): {reply.text[:300]!r}")
            try:
                scores = reply.json()["scores"]
                if not isinstance(scores, list):
                    raise TypeError(f"scores is a {type(scores).__name__}")
            except (ValueError, KeyError, TypeError) as exc:
                raise RewardError(f"reward service {self.url} replied {reply.text[:200]!r}: expected JSON "
                                  f"{{\"scores\": [one number per sample]}} ({type(exc).__name__}: {exc})") from None
            return checked_scores(scores, f"reward service {self.url}", prompts, completions)
        raise ServiceUnavailable(f"reward service {self.url} is unavailable: {self.retries + 1} attempts failed, the last "
                                 f"with {problem} (the stage exits to be retried; reward.http sets timeout_s, retries, backoff_s)")

    def close(self) -> None:
        self.client.close()
