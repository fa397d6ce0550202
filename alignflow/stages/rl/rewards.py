"""Rewards for the RL stage: a Python function from a file, and the shaping applied to any source.

A reward function is named in the config as `path/to/file.py:name` and called once per batch:

    name(prompts=[str], completions=[str], prompt_ids=[[int]], completion_ids=[[int]], **columns) -> [float]

where `columns` holds the prompt rows' other columns (e.g. `answer=[...]`), one value per
sample. It must return one finite float per sample. If it raises, it is called again sample
by sample to name the first sample that fails; a NaN or infinity is an error naming the sample.
A bad reward is never turned into a silent zero.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from alignflow.stages.common.data import DataError
from alignflow.stages.common.formats import finite_number


class RewardError(DataError):
    """A reward function that raised, returned the wrong number of values, or a non-finite value:
    bad input (the stage exits with code 2 and is not retried), not a crash."""


def load_function(spec: str, kind: str = "function") -> Callable[..., Any]:
    """The callable `name` of `path/to/file.py:name` (a reward function, or an environment class)."""
    path, _, name = spec.rpartition(":")
    module_spec = importlib.util.spec_from_file_location(f"alignflow_reward_{Path(path).stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise RewardError(f"cannot import {path}, the file of {kind} {name!r}")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # the user's file: its error is bad input, shown where it is
        where = f"{exc.filename}:{exc.lineno}: " if isinstance(exc, SyntaxError) else ""
        raise RewardError(f"{where}importing {path} (the file of {kind} {name!r}) failed: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"{path} has no {kind} {name!r}")
    return fn


def checked_scores(values: list[Any], source: str, prompts: list[str], completions: list[str]) -> torch.Tensor:
    """One finite number per sample, as a (N,) tensor; else a `RewardError` naming `source` and the sample."""
    if len(values) != len(prompts):
        raise RewardError(f"{source} returned {len(values)} values for {len(prompts)} samples")
    for i, v in enumerate(values):
        if not finite_number(v):
            raise RewardError(f"{source} returned {v!r} for sample {i} "
                              f"(prompt {prompts[i]!r}, completion {completions[i]!r}): rewards must be finite numbers")
    return torch.tensor(values, dtype=torch.float32)


class FunctionReward:
    def __init__(self, spec: str):
        self.spec, self.fn = spec, load_function(spec)

    def __call__(self, prompts: list[str], completions: list[str], prompt_ids: list[list[int]],
                 completion_ids: list[list[int]], columns: dict[str, list[Any]]) -> torch.Tensor:
        args = dict(prompts=prompts, completions=completions, prompt_ids=prompt_ids, completion_ids=completion_ids, **columns)
        try:
            values = list(self.fn(**args))
        except Exception as exc:
            if threading.current_thread() is not threading.main_thread() and "main thread" in str(exc):
                raise RewardError(f"reward function {self.spec} works only in the main thread ({type(exc).__name__}: {exc}), "
                                  "e.g. with a signal-based timeout such as math_verify's; with rl.rollout.asynchronous it "
                                  "runs in a background thread: use a timeout without signals, or set "
                                  "rl.rollout.asynchronous: false") from exc
            raise self._first_failure(args, exc) from exc
        return checked_scores(values, f"reward function {self.spec}", prompts, completions)

    def _first_failure(self, args: dict[str, list[Any]], exc: Exception) -> RewardError:
        for i in range(len(args["prompts"])):
            try:
                self.fn(**{k: v[i:i + 1] for k, v in args.items()})
            except Exception as one:
                return RewardError(f"reward function {self.spec} raised on sample {i} (prompt {args['prompts'][i]!r}, "
                                   f"completion {args['completions'][i]!r}): {type(one).__name__}: {one}")
        return RewardError(f"reward function {self.spec} raised on the batch of {len(args['prompts'])}: {type(exc).__name__}: {exc}")


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, Eq. 13): 0 up to max - buffer tokens, then
    falling linearly to -penalty at max_new_tokens."""
    if buffer == 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_new_tokens - buffer)).clamp(min=0)
    return -penalty * over / buffer
