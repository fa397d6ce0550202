"""Agents in the user's own code: `rl.agent.path: file.py:run` with

    def run(client: openai.OpenAI, row: dict) -> float | dict          # or: async def run(client: openai.AsyncOpenAI, row)

`client` talks to the policy being trained through the stage's OpenAI-compatible endpoint (`openai_server.py`);
its API key is the episode's id, so every call it makes is recorded under the episode. `row` is the prompt row
({"prompt": str, **other columns}). The return value is the episode's reward, or {"reward": float, **metrics}
(numbers, logged as their means under `agent/`).

Episodes run on daemon threads, `agent.concurrency` at a time; one that has not returned after `agent.timeout_s`
is closed (its later calls are refused) and dropped. Dropped too: an episode that raised, returned something else,
or never called the model (nothing to train on). Dropped episodes are counted (`agent/dropped_fraction`) and left
out of their group's baseline; past `agent.max_dropped_fraction` of a step the stage fails with the first error,
naming the row (bad input, exit code 2).

**How an episode becomes training data.** One row per episode, from its calls in the order they returned:
- a call whose prompt ids start with the row so far (the usual chat loop: the template renders the earlier
  turns as they were sampled) continues the row: the prompt's new tokens (tool results, user turns) enter with
  mask 0, its sampled tokens with mask 1;
- a call whose prompt does not (a template that re-renders an earlier assistant turn, e.g. dropping its
  reasoning; or an agent that edits its history) starts a new segment of the same row with its own prompt,
  position ids restarting at 0 and no attention to the segments before it.
Either way every sampled token is trained in exactly the context it was sampled in, with the log-prob the
engine reported; the episode's reward sits on its last sampled token, and the estimators treat the episode's
sampled tokens as one trajectory (as for `environment` episodes).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from alignflow.stages.common.formats import finite_number
from alignflow.stages.common.generation import Rollout, SamplingParams
from alignflow.stages.rl.data import PromptRow
from alignflow.stages.rl.executors import Episodes
from alignflow.stages.rl.openai_server import Call, OpenAIServer
from alignflow.stages.rl.rewards import RewardError, load_function


def load_agent(spec: str) -> Callable[..., Any]:
    return load_function(spec, kind="agent function")


def episode_rollout(calls: list[Call]) -> Rollout:
    """One row from an episode's calls (module docstring): prompt = the first call's prompt; each later call either
    continues the row or opens a segment with position ids from 0."""
    first = calls[0]
    ids, logps, actions = list(first.response_ids), list(first.logprobs), [1] * len(first.response_ids)
    positions = list(range(len(first.prompt_ids) + len(first.response_ids)))
    segment = first.prompt_ids + first.response_ids  # the tokens the current segment's next call must extend
    segmented = False
    for call in calls[1:]:
        if call.prompt_ids[:len(segment)] == segment:
            new = call.prompt_ids[len(segment):]
            start = positions[-1] + 1
        else:
            new, start, segmented, segment = call.prompt_ids, 0, True, []
        ids += new + call.response_ids
        logps += [0.0] * len(new) + call.logprobs
        actions += [0] * len(new) + [1] * len(call.response_ids)
        positions += list(range(start, start + len(new) + len(call.response_ids)))
        segment = segment + new + call.response_ids
    return Rollout(first.prompt_ids, ids, logps, calls[-1].finish_reason, actions if len(calls) > 1 else None,
                   positions if segmented else None)


@dataclass
class Outcome:
    reward: float | None = None
    metrics: dict[str, float] | None = None
    error: str | None = None  # why the episode was dropped


class AgentExecutor:
    """Runs the user's agent function for params.n episodes per row against the stage's endpoint (module docstring)."""

    def __init__(self, server: OpenAIServer, fn: Callable[..., Any], spec: str, *, concurrency: int, timeout_s: float,
                 max_dropped_fraction: float):
        self.server, self.fn, self.spec = server, fn, spec
        self.concurrency, self.timeout_s, self.max_dropped_fraction = concurrency, timeout_s, max_dropped_fraction
        self.is_async = inspect.iscoroutinefunction(fn)
        self._http = None  # one connection pool for the sync clients of a batch (a client of its own costs ~30 ms here)

    def run(self, rows: list[PromptRow], params: SamplingParams) -> Episodes:
        self.server.sampling = replace(params, n=1)
        self.server.batcher.reseed(params.seed)
        jobs = [(i, row) for i, row in enumerate(rows) for _ in range(params.n)]
        episodes = [self.server.book.open() for _ in jobs]
        with self._pool() as self._http:
            outcomes = self._run_all(jobs, episodes)
        calls = [self.server.book.close(e) for e in episodes]
        error = self.server.batcher.take_error()
        if error is not None:  # an engine failed (e.g. died): the stage's failure, retried, not the agent's
            raise error
        for outcome, made in zip(outcomes, calls):
            if outcome.error is None and not made:
                outcome.error = "the agent returned without calling the model: nothing to train on"
        self._check(jobs, outcomes)
        return self._episodes(outcomes, calls)

    def _pool(self):
        """The connection pool the sync clients of one batch share."""
        import httpx
        import openai

        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        return openai.DefaultHttpxClient(limits=limits, timeout=self.timeout_s)

    def _run_all(self, jobs: list[tuple[int, PromptRow]], episodes: list[str]) -> list[Outcome]:
        """Every episode on a daemon thread, `concurrency` at a time; a hung one is abandoned at its timeout."""
        todo: queue.Queue = queue.Queue()
        for k in range(len(jobs)):
            todo.put(k)
        outcomes: list[Outcome | None] = [None] * len(jobs)
        started: dict[int, float] = {}
        lock = threading.Lock()

        def worker() -> None:
            while True:
                try:
                    k = todo.get_nowait()
                except queue.Empty:
                    return
                with lock:
                    started[k] = time.monotonic()
                try:
                    result = self._episode(episodes[k], jobs[k][1])
                except BaseException as exc:  # nothing the agent does may leave an episode without an outcome
                    result = Outcome(error=f"raised {type(exc).__name__}: {exc}")
                with lock:
                    if outcomes[k] is not None:  # given up on at its timeout: a fresh thread has this slot
                        return
                    outcomes[k] = result
                    started.pop(k, None)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(self.concurrency, len(jobs)))]
        for t in threads:
            t.start()
        while any(o is None for o in outcomes):
            time.sleep(0.05)
            with lock:
                late = [k for k, t0 in started.items() if time.monotonic() - t0 > self.timeout_s]
                for k in late:  # its thread stays blocked in user code: a fresh one takes over its slot
                    outcomes[k] = Outcome(error=f"timed out after {self.timeout_s:g} s")
                    started.pop(k)
                    self.server.book.close(episodes[k])
            for _ in late:
                threading.Thread(target=worker, daemon=True).start()
        return outcomes  # type: ignore[return-value]

    def _episode(self, episode: str, row: PromptRow) -> Outcome:
        import openai

        data = {"prompt": row.text, **row.columns}
        try:
            if self.is_async:
                async def go():
                    async with openai.AsyncOpenAI(base_url=self.server.url, api_key=episode, max_retries=0,
                                                  timeout=self.timeout_s) as client:
                        return await self.fn(client, data)
                value = asyncio.run(go())
            else:  # not closed after the episode: closing it would close the shared pool
                client = openai.OpenAI(base_url=self.server.url, api_key=episode, max_retries=0, timeout=self.timeout_s,
                                       http_client=self._http)
                value = self.fn(client, data)
        except Exception as exc:
            return Outcome(error=f"raised {type(exc).__name__}: {exc}")
        return self._parse(value)

    def _parse(self, value: Any) -> Outcome:
        metrics = {}
        if isinstance(value, dict):
            metrics = {k: v for k, v in value.items() if k != "reward"}
            value = value.get("reward")
        bad = [k for k, v in metrics.items() if not finite_number(v)]
        if not finite_number(value) or bad:
            what = f"metric {bad[0]}={metrics[bad[0]]!r}" if bad else f"reward {value!r}"
            return Outcome(error=f"returned {what}: expected a finite reward, or {{'reward': float, **numeric metrics}}")
        return Outcome(float(value), {k: float(v) for k, v in metrics.items()})

    def _check(self, jobs: list[tuple[int, PromptRow]], outcomes: list[Outcome]) -> None:
        dropped = [k for k, o in enumerate(outcomes) if o.error is not None]
        if not dropped:
            return
        k = dropped[0]
        if len(dropped) <= self.max_dropped_fraction * len(outcomes):  # said once per batch: the user's agent may have a bug
            print(f"agent {self.spec}: {len(dropped)} of {len(outcomes)} episodes dropped; the first, on row {jobs[k][0]} "
                  f"(prompt {jobs[k][1].text!r}): {outcomes[k].error}", flush=True)
        else:
            raise RewardError(f"agent {self.spec}: {len(dropped)} of {len(outcomes)} episodes dropped (more than "
                              f"agent.max_dropped_fraction={self.max_dropped_fraction:g}); the first, on row {jobs[k][0]} "
                              f"(prompt {jobs[k][1].text!r}): {outcomes[k].error}")

    def _episodes(self, outcomes: list[Outcome], calls: list[list[Call]]) -> Episodes:
        kept = torch.tensor([o.error is None for o in outcomes])
        rollouts = [episode_rollout(c) if o.error is None else Rollout([0], [], [], "length") for o, c in zip(outcomes, calls)]
        scores = torch.tensor([o.reward if o.error is None else 0.0 for o in outcomes], dtype=torch.float32)
        names = sorted({k for o in outcomes if o.metrics for k in o.metrics})
        stats = {"agent/calls": torch.tensor([float(len(c)) for c in calls]), "agent/dropped_fraction": (~kept).float(),
                 **{f"agent/{k}": torch.tensor([o.metrics.get(k, math.nan) if o.metrics else math.nan for o in outcomes])
                    for k in names}}
        return Episodes(rollouts, scores, stats, kept)
