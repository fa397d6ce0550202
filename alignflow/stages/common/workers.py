"""Ray worker groups inside a stage's job: N actors of one role, placed in placement-group bundles.

A group's workers are Ray actors. Rank 0 picks the rendezvous address (its node's IP and a
free port) and every worker sets the usual variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) before the training seam starts its process group, so a role
trains with DeepSpeed across its workers exactly as torchrun processes would. Torch threads
follow the CPUs of the worker's bundle: colocated roles share a bundle but run their
phases one after another, so each may use all of it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

from alignflow.infra.secrets import load_job_secrets, without_secrets
from alignflow.infra.services import reproducible_math_env

PLACEMENT_TIMEOUT_S = 120
# Set on every worker: the CPUs of its bundle, read by the training seam (`strategy.py`). Defined
# here, not there, so a worker group imports neither torch nor DeepSpeed until its workers need them.
THREADS_ENV = "ALIGNFLOW_THREADS_PER_WORKER"
# Ray starts actors at nice 15 (a job's driver at 0). A role's workers do the stage's compute, so on a core shared
# with any process at normal priority (a parallel branch's stage job, someone else's work) one got about 3% of it and
# an RL step took tens of times longer. They run at the job's priority, as Ray runs the driver: an actor's env_vars
# are merged with the job's, and its worker process applies this niceness when it starts.
AT_THE_JOBS_PRIORITY = {"env_vars": {"RAY_worker_niceness": "0"}}


def connect_ray(num_cpus: int | None = None) -> Callable[[], None]:
    """Join the cluster of the Ray job this runs in (Ray sets RAY_ADDRESS there). Run by hand, start
    a private local Ray instead: never a bare `ray.init()`, which joins whatever cluster the machine
    last started. Returns what undoes this call: nothing when Ray was already up; disconnecting;
    or, for a private instance, stopping it and removing its temp folder."""
    import ray

    if ray.is_initialized():
        return lambda: None
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return ray.shutdown
    else:
        # Explicit, so a private instance neither writes ~/.ray/auth_token (which would switch every Ray
        # head started later on this machine to token auth) nor depends on one being there.
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.update(reproducible_math_env())  # the workers start from this environment
        temp = tempfile.mkdtemp(prefix="afray-", dir="/tmp")  # short: Ray's socket paths have a length limit
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, _temp_dir=temp,
                 log_to_driver=True, runtime_env={"env_vars": without_secrets({k: v for k, v in os.environ.items() if k.startswith(("ALIGNFLOW_", "AWS_", "HF_"))})})

        def stop() -> None:
            ray.shutdown()
            shutil.rmtree(temp, ignore_errors=True)

        return stop


@dataclass(frozen=True)
class Slot:
    """Where one worker goes: a bundle of a placement group, and its share of that bundle."""

    group: Any  # ray PlacementGroup
    bundle: int
    cpus: float
    gpus: float
    threads: int


def plan_slots(roles: dict[str, int], cpus_per_bundle: float, gpus_per_bundle: float, colocate: str) -> dict[str, list[Slot]]:
    """Placement groups for the roles ({role: workers}) and each worker's slot.

    colocate: `all` = every role in the same bundles; `pairs` = actor + reference, critic + reward,
    the rest apart; `none` = a placement group per role. Roles in one bundle split its resources."""
    from ray.util.placement_group import placement_group

    if colocate == "all":
        sets = [list(roles)]
    elif colocate == "pairs":
        sets = [[r for r in pair if r in roles] for pair in (("actor", "reference"), ("critic", "reward"))]
        sets += [[r] for r in roles if not any(r in s for s in sets)]
        sets = [s for s in sets if s]
    else:
        sets = [[r] for r in roles]
    slots: dict[str, list[Slot]] = {}
    for members in sets:
        size = max(roles[r] for r in members)
        bundle = {"CPU": cpus_per_bundle, **({"GPU": gpus_per_bundle} if gpus_per_bundle else {})}
        group = placement_group([dict(bundle) for _ in range(size)], strategy="PACK")
        try:
            _wait_ready(group, members, bundle, size)
        except RuntimeError:
            release({"": [Slot(group, 0, 0, 0, 1)]})
            raise
        for role in members:
            sharing = [sum(1 for r in members if roles[r] > i) for i in range(size)]
            slots[role] = [Slot(group, i, cpus_per_bundle / sharing[i], gpus_per_bundle / sharing[i], max(1, int(cpus_per_bundle)))
                           for i in range(roles[role])]
    return slots


def release(slots: dict[str, list[Slot]]) -> None:
    """Remove the placement groups of a plan (their bundles go back to the cluster)."""
    from ray.util import remove_placement_group

    for group in {id(s.group): s.group for role in slots.values() for s in role}.values():
        remove_placement_group(group)


def _wait_ready(group, members: list[str], bundle: dict[str, float], size: int) -> None:
    import ray

    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        raise RuntimeError(
            f"Ray could not place {size} bundle(s) of {bundle} for {', '.join(members)} within {PLACEMENT_TIMEOUT_S}s; "
            f"the cluster has {ray.cluster_resources()}: lower the workers or their CPUs/GPUs, or colocate roles"
        )


class Worker:
    """Base of every role's Ray actor: process-group variables and thread count."""

    def __init__(self, rank: int, world_size: int, threads: int):
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", **{THREADS_ENV: str(threads)})
        load_job_secrets()  # a worker reads and writes storage too; the job's runtime_env holds no credentials
        import torch

        torch.set_num_threads(threads)
        self.rank, self.world_size = rank, world_size

    def peak_rss_mib(self) -> float:
        from alignflow.stages.common.progress import peak_rss_mib

        return peak_rss_mib()

    def rendezvous(self) -> tuple[str, int]:
        import ray

        from alignflow.infra.ports import free_port

        return ray.util.get_node_ip_address(), free_port()

    def join(self, where: tuple[str, int]) -> None:
        address, port = where
        os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port))

    def ping(self) -> int:
        return os.getpid()


class WorkerGroup:
    """The workers of one role. `call` runs a method on every worker and returns their results in rank order.

    Creating a group does not wait: its workers start (a process each, importing torch) while the caller
    goes on, and each worker learns rank 0's rendezvous address before it runs anything called later (a
    Ray actor runs one caller's calls in the order they were made)."""

    def __init__(self, role: str, cls: type, slots: list[Slot]):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.role, remote = role, ray.remote(cls)
        self.workers = [
            remote.options(num_cpus=slot.cpus, num_gpus=slot.gpus, name=None, runtime_env=AT_THE_JOBS_PRIORITY,
                           scheduling_strategy=PlacementGroupSchedulingStrategy(slot.group, placement_group_bundle_index=slot.bundle)
                           ).remote(rank, len(slots), slot.threads)
            for rank, slot in enumerate(slots)
        ]
        where = self.workers[0].rendezvous.remote()
        self.joined = [w.join.remote(where) for w in self.workers]

    def submit(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Start `method` on every worker without waiting: their results' refs, in rank order."""
        import ray

        if len(self.workers) > 1:  # one copy in the object store for all workers, not one per call
            args = tuple(a if isinstance(a, ray.ObjectRef) else ray.put(a) for a in args)
        return [getattr(w, method).remote(*args, **kwargs) for w in self.workers]

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        import ray

        return ray.get(self.submit(method, *args, **kwargs))

    def call_each(self, method: str, per_worker: list[tuple]) -> list[Any]:
        """Worker i runs `method(*per_worker[i])`: for shards of data."""
        import ray

        return ray.get([getattr(w, method).remote(*args) for w, args in zip(self.workers, per_worker)])

    def kill(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)
