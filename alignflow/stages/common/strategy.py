"""The one seam to DeepSpeed and torch.distributed.

Everything distributed goes through here: process-group init (gloo on CPU, nccl
on GPU), wrapping model/optimizer/scheduler in a DeepSpeed engine (ZeRO 0/2/3,
optimizer offload, bf16/fp32, accumulation, clipping), backward/step, metric
all-reduce, step checkpoints, and gathering full weights for an HF save.
Nothing else in alignflow imports deepspeed.

Process layout comes from the usual env vars (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) as set by torchrun, Ray worker groups or by hand; a
plain single process needs none of them.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import torch

from alignflow.config.base import BatchConfig, DeepSpeedConfig, OptimConfig
from alignflow.infra.ports import free_port
from alignflow.stages.common.models import transformers_without_unused_extras, warn_if_bf16_is_slow
from alignflow.stages.common.workers import THREADS_ENV  # set by worker groups: the CPUs Ray gave this worker

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must be set before deepspeed is imported

import torch.distributed as dist  # noqa: E402


def _import_deepspeed():
    """DeepSpeed's autotuner imports MLflow when DeepSpeed is imported (3 s of every worker's start here), only
    to log autotuning runs, which alignflow never starts. A process that has not imported MLflow imports
    DeepSpeed without it; MLflow itself imports as usual afterwards (the stage's tracking imports it when needed)."""
    import sys

    if "mlflow" in sys.modules:
        import deepspeed
        return deepspeed
    sys.modules["mlflow"] = None  # `import mlflow` raises ImportError while this is set
    try:
        import deepspeed
    finally:
        del sys.modules["mlflow"]
    return deepspeed


deepspeed = _import_deepspeed()


def lr_lambda(optim: OptimConfig, total_steps: int):
    """Linear warmup, then cosine decay to min_lr_ratio (or constant)."""

    def factor(step: int) -> float:
        if optim.warmup_steps and step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        if optim.scheduler == "constant":
            return 1.0
        span = max(1, total_steps - optim.warmup_steps)
        progress = min(1.0, (step - optim.warmup_steps) / span)
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def threads_per_worker(world_size: int) -> int:
    if os.environ.get(THREADS_ENV):
        return max(1, int(float(os.environ[THREADS_ENV])))
    return max(1, int(os.environ.get("ALIGNFLOW_NUM_THREADS", os.cpu_count() or 1)) // world_size)


class Strategy:
    """Holds the process group facts and, after `prepare` (or `prepare_frozen`), the DeepSpeed engine.
    `optim` None: a frozen model that only runs forward (RL's reference and reward model)."""

    def __init__(self, ds: DeepSpeedConfig, batch: BatchConfig, optim: OptimConfig | None):
        self.ds, self.batch, self.optim = ds, batch, optim
        self.engine = None
        self.frozen_params = False  # some parameters are not trained (LoRA): checkpoints hold only the trained ones
        self._hf_ds_config = None
        self._grad_norm = float("nan")
        self._init_process_group()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
        per_step = batch.global_batch_size
        if optim is not None and per_step % (batch.micro_batch_size * self.world_size):
            raise ValueError(
                f"batch.global_batch_size={per_step} is not a multiple of micro_batch_size "
                f"({batch.micro_batch_size}) x workers ({self.world_size})"
            )
        self.grad_accum = per_step // (batch.micro_batch_size * self.world_size) if optim is not None else 1
        if ds.precision == "bf16":
            warn_if_bf16_is_slow("deepspeed.precision: bf16")
        if torch.cuda.is_available():
            torch.cuda.set_device(self.device)
        else:
            # Several workers on a few cores oversubscribe badly without this.
            torch.set_num_threads(threads_per_worker(self.world_size))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _init_process_group(self) -> None:
        if dist.is_initialized():
            return
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" not in os.environ:
            # One process on CPU rendezvouses through an in-memory store, not a TCP store on the port picked here
            # (another process can take that port before the store binds it: EADDRINUSE failed a stage job once).
            # DeepSpeed adopts this group. MASTER_PORT stays set for code that reads it.
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            if not torch.cuda.is_available():
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        if not torch.cuda.is_available():
            # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op in every new process (one to
            # three minutes of C++ per stage job here, rebuilt by each): gloo's all-reduce serves instead.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)

    def ds_config(self) -> dict[str, Any]:
        zero: dict[str, Any] = {"stage": self.ds.zero_stage}
        if self.ds.offload_optimizer and self.optim is not None:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        if self.ds.zero_stage == 3:
            zero["stage3_gather_16bit_weights_on_model_save"] = False
        return {
            "train_batch_size": self.batch.micro_batch_size * self.grad_accum * self.world_size,
            "train_micro_batch_size_per_gpu": self.batch.micro_batch_size,
            "gradient_accumulation_steps": self.grad_accum,
            "gradient_clipping": 0.0 if self.optim is None or self._clips_itself() else self.optim.grad_clip,
            "zero_optimization": zero,
            "bf16": {"enabled": self.ds.precision == "bf16"},
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }

    @contextmanager
    def model_init(self) -> Iterator[None]:
        """Context for building the model: under ZeRO-3, weights are partitioned as they load."""
        if self.ds.zero_stage != 3:
            yield
            return
        transformers_without_unused_extras()
        from transformers.integrations import HfDeepSpeedConfig

        self._hf_ds_config = HfDeepSpeedConfig(self.ds_config())  # transformers reads it while it stays alive
        yield

    def prepare(self, model: torch.nn.Module, total_steps: int) -> Any:
        params = [p for p in model.parameters() if p.requires_grad]
        # LoRA: the frozen base is the starting model, which the stage loads anyway; checkpoints leave it out.
        self.frozen_params = len(params) < len(list(model.parameters()))
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": self.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        kwargs = dict(lr=self.optim.lr, betas=self.optim.betas, eps=self.optim.eps)
        if self.ds.offload_optimizer:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
        else:
            # The fused kernel (one pass over each tensor for every Adam update) on CPU and GPU: 0.54 vs 2.66 ms a
            # step for the tiny model's 38 tensors here, the same update up to rounding.
            optimizer = torch.optim.AdamW(groups, fused=True, **kwargs)
        # The scheduler is built on the optimizer DeepSpeed hands back: ZeRO-3 regroups parameters.
        schedule = lr_lambda(self.optim, total_steps)
        make_scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule)  # noqa: E731
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=make_scheduler, config=self.ds_config(), dist_init_required=False
        )
        if self.world_size == 1 and self.ds.zero_stage == 0:
            # One process has nothing to reduce, but DeepSpeed's fallback all-reduce still flattens and copies every
            # gradient after each backward (44 ms a micro-batch on builtin:small).
            self.engine.enable_backward_allreduce = False
        return self.engine

    def prepare_frozen(self, model: torch.nn.Module) -> Any:
        """A model that only runs forward. Under ZeRO-3 its weights stay partitioned over the workers
        (built inside `model_init`) and are gathered layer by layer in each forward, so every worker
        must run the same number of forwards (`rowwise.all_rows` does). ZeRO-1/2 partition optimizer
        states and gradients, which a frozen model has none of: there it stays a plain module, and
        `engine` is that module."""
        model.requires_grad_(False)
        if self.ds.zero_stage == 3:
            self.engine, *_ = deepspeed.initialize(model=model, config=self.ds_config(), dist_init_required=False)
        else:
            self.engine = model.to(self.device)
        self.engine.eval()
        return self.engine

    # ---------------------------------------------------------------- training step

    def backward(self, loss: torch.Tensor) -> None:
        """`loss` must be this micro-batch's share of the step objective (it sums to the objective
        over all micro-batches of all ranks). DeepSpeed divides by the accumulation steps and
        averages over ranks; scaling by both undoes that, so the step gradient is exact."""
        self.engine.backward(loss * (self.grad_accum * self.world_size))

    def _clips_itself(self) -> bool:
        """ZeRO-0 in fp32: DeepSpeed would clip with a Python loop over the tensors that computes again the norm
        `step` takes anyway (1.3 of a 35.6 ms RM step on builtin:tiny); torch's foreach kernels clip with that norm.
        Elsewhere DeepSpeed's optimizer wrappers clip their own (fp32 master, partitioned) gradients."""
        return self.optim is not None and self.optim.grad_clip > 0 and self.ds.zero_stage == 0 and self.ds.precision == "fp32"

    def step(self) -> None:
        if self.ds.zero_stage == 0 and self.engine.is_gradient_accumulation_boundary():
            # ZeRO-0 does not record the norm; grads are already all-reduced here, before clipping.
            params = [p for p in self.engine.module.parameters() if p.grad is not None]
            self._grad_norm = 0.0
            if params:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params])
                self._grad_norm = float(norm)
                if self._clips_itself():
                    torch.nn.utils.clip_grads_with_norm_(params, self.optim.grad_clip, norm, foreach=True)
        self.engine.step()

    def grad_norm(self) -> float:
        """Global gradient norm of the last optimizer step, before clipping."""
        if self.ds.zero_stage == 0:
            return self._grad_norm
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def all_reduce_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place. Callers fill disjoint rows and leave zeros elsewhere, so the
        sum is exact: every rank ends with the same full tensor."""
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    # ---------------------------------------------------------------- checkpoints and weights

    def save_checkpoint(self, folder: str, tag: str, client_state: dict[str, Any]) -> None:
        if self.frozen_params and "module_state_dict" not in vars(self.engine):
            self.engine.module_state_dict = self._trained_state_dict
        self.engine.save_checkpoint(folder, tag=tag, client_state=client_state, save_latest=False,
                                    exclude_frozen_parameters=self.frozen_params)

    def _trained_state_dict(self, **kwargs) -> dict[str, torch.Tensor]:
        """DeepSpeed's module state without frozen weights, tied ones included: DeepSpeed drops a frozen weight by its
        first name only, so a frozen embedding tied to the output head was saved under the head's name."""
        state = type(self.engine).module_state_dict(self.engine, **kwargs)
        frozen = {n for n, p in self.engine.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
        return {k: v for k, v in state.items() if k not in frozen}

    def load_checkpoint(self, folder: str, tag: str) -> dict[str, Any]:
        path, client_state = self.engine.load_checkpoint(folder, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True,
                                                         load_module_strict=not self.frozen_params)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {tag!r} from {folder}")
        return client_state

    def full_state_dict(self, trained_only: bool = False) -> dict[str, torch.Tensor] | None:
        """Full fp32/bf16 weights on rank 0 (gathered under ZeRO-3, one tensor at a time); None elsewhere.
        `trained_only`: just the parameters that train (a LoRA adapter), no buffers."""
        module = self.engine.module
        out: dict[str, torch.Tensor] = {}
        for name, param in module.named_parameters():
            if trained_only and not param.requires_grad:
                continue
            gather = deepspeed.zero.GatheredParameters([param], modifier_rank=None) if hasattr(param, "ds_id") else nullcontext()
            with gather:
                if self.is_main:
                    out[name] = param.detach().to("cpu", copy=True)
        if self.is_main and not trained_only:
            persistent = set(module.state_dict().keys())  # skips non-persistent buffers such as rotary inv_freq
            for name, buf in module.named_buffers():
                if name in persistent:
                    out.setdefault(name, buf.detach().to("cpu", copy=True))
        return out if self.is_main else None

    def unwrap(self) -> torch.nn.Module:
        return self.engine.module

    def close(self) -> None:
        """End of a stage: wait for every rank. The process group is kept: DeepSpeed caches it,
        and a process that runs a second stage in-process (tests, notebooks) reuses it."""
        self.barrier()
