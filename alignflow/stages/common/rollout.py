"""Rollout engines as Ray actors, shared by the stages that sample (rl, generate): one `RolloutWorker` per engine,
and `EngineGroup.generate`, which spreads prompts over the engines."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import torch

from alignflow.config.base import GenerationConfig, ModelConfig
from alignflow.stages.common.generation import HFGenerator, Rollout, SamplingParams
from alignflow.stages.common.models import load_causal_lm, load_tokenizer
from alignflow.stages.common.workers import THREADS_ENV, Worker, WorkerGroup

KILL_ENGINE_ENV = "ALIGNFLOW_KILL_ENGINE_AT_CALL"  # tests: rollout worker 0 exits during its Nth generate call
ENGINE_SEED_STRIDE = 7919  # engine k of a call samples with seed + k * stride


class EngineError(RuntimeError):
    """A rollout engine failed mid-call (retryable: the stage resumes from what it has stored)."""


class RolloutWorker(Worker):
    """A rollout engine: `hf` (a local copy of the policy) or `vllm` (one vllm.LLM)."""

    def setup(self, gen: GenerationConfig, model_cfg: ModelConfig, model_path: str, max_model_len: int | None, seed: int,
              lora_rank: int | None = None, kill_at_call: str | None = None) -> None:
        tokenizer = load_tokenizer(model_path)
        self.calls, self.kill_at_call = 0, kill_at_call
        if gen.engine == "vllm":
            from alignflow.stages.common.vllm_engine import VLLMGenerator

            self.generator = VLLMGenerator(model_path, tokenizer.eos_token_id, seed=seed + self.rank,
                                           max_model_len=max_model_len, tensor_parallel_size=gen.tensor_parallel_size,
                                           gpu_memory_utilization=gen.gpu_memory_utilization, sleep=gen.sleep,
                                           threads=int(os.environ.get(THREADS_ENV, "1")), lora_rank=lora_rank)
        else:
            self.generator = HFGenerator(load_causal_lm(model_path, model_cfg), tokenizer.eos_token_id, tokenizer.pad_token_id,
                                         gen.batch_size)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        self.calls += 1
        if self.kill_at_call == str(self.calls):  # fault injection (tests): the engine dies mid-rollout
            os._exit(17)
        return self.generator.generate(prompts, params)

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        return self.generator.score(sequences)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.load_weights(state)

    def load_adapter(self, adapter) -> None:
        self.generator.load_adapter(*adapter)

    def sleep(self) -> None:
        self.generator.sleep()

    def wake_up(self) -> None:
        self.generator.wake_up()


def shards(n: int, k: int) -> list[list[int]]:
    """0..n-1 in k contiguous, nearly equal parts (some may be empty)."""
    bounds = np.linspace(0, n, k + 1).round().astype(int)
    return [list(range(bounds[i], bounds[i + 1])) for i in range(k)]


def generate_on(group: WorkerGroup, prompts: list[list[int]], params: SamplingParams, engine: str) -> list[Rollout]:
    """Prompts sharded over the group's engines, in order; engine k samples with its own seed stream."""
    import ray

    parts = shards(len(prompts), len(group.workers))
    calls = [([prompts[i] for i in part], replace(params, seed=params.seed + ENGINE_SEED_STRIDE * k)) for k, part in enumerate(parts)]
    try:
        out = group.call_each("generate", calls)
    except ray.exceptions.RayActorError as err:  # the call fails; the stage resumes from what it stored on retry
        raise EngineError(f"a rollout engine ({engine}) died during generation: {err}") from err
    return [r for chunk in out for r in chunk]
