"""Orchestration overhead of `alignflow run` and the fully cached re-run time.

Run: .venv/bin/python benchmarks/orchestration.py [--steps 60] [--repeat 5] [--json out.json]

Starts a private Ray head on 127.0.0.1 (timed, with the one no-op job it runs before it takes stage jobs),
then runs the tiny pipeline twice with `alignflow run` in a subprocess (Prefect's temporary server, MLflow on
sqlite, storage in a temporary folder), reading the run summary each time:

- task seconds: the stage task's wall time inside the flow (cache check, config upload,
  job submission, log streaming, waiting, manifest verification, MLflow calls);
- job seconds: the Ray job's wall time from submission to its terminal state;
- stage compute: what the stage itself reports, `time/setup_s` (tokenizer, data, model,
  DeepSpeed engine) + `time/train_s` (the training loop with its evals and checkpoints) + `time/final_s`
  (figures computed after training: a reward model's normalization pass over its data);
- overhead = task seconds - stage compute: process start and imports in the job (a fork of the head's warm
  stage server, infra/warm.py, on a head alignflow starts: the benchmark's is one), Ray job scheduling,
  publishing (the curves, the HF save, the manifest), and the orchestration itself.
It also counts the stage jobs that say they were forked from the warm server, and prints any that started fresh
with the reason they gave.
Then `configs/tiny-ppo.yaml` (sft -> rm -> ppo) runs once on the same head, and its stages join the table.
The second run of the tiny pipeline is fully cached: no Ray job and, with no Prefect server configured, no
Prefect flow either (`alignflow run` answers it before Prefect's temporary server would start), so its time
is the command's start-up (imports) and the MLflow record. The third is the same fully cached run as a user
types it, with no Ray address given (checked in its log: no private head started). Last, the fully cached
PPO graph as typed, the issue's case, and the same with `--flow-run` (through Prefect's temporary server).
After the head is stopped, before the third run, the tiny pipeline runs as a user first types it, with no service
up and new storage: `alignflow run` starts Prefect's temporary server and, beside it (the run knows a stage must
run), a private Ray head.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PPO = "configs/tiny-ppo.yaml"
sys.path.insert(0, str(ROOT))


def run_pipeline(env: dict[str, str], root: str, steps: int | None, out: Path, config: str = "configs/tiny.yaml",
                 *extra: str) -> tuple[dict, float, str]:
    cmd = [sys.executable, "-m", "alignflow.cli", "run", config, "--set", f"storage.root={root}",
           *(["--set", f"sft.batch.max_steps={steps}"] if steps else []), "--summary-json", str(out), *extra]
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.time() - start
    if proc.returncode:
        raise SystemExit(f"alignflow run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text()), wall, proc.stderr


def compute_s(stage: dict) -> float:
    """What the stage itself reports as its own work (see above); the rest of its task's time is overhead."""
    return sum(stage["metrics"].get(f"time/{part}_s", 0.0) for part in ("setup", "train", "final"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeat", type=int, default=5, help="fully cached PPO runs as typed (the median is reported)")
    args = parser.parse_args()

    from alignflow.infra.services import remove_home, start_ray_head

    work = Path(tempfile.mkdtemp(prefix="af-orch-"))
    start = time.time()
    head = start_ray_head()
    ray_start = time.time() - start
    env = {**os.environ, "ALIGNFLOW_RAY_ADDRESS": head.url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_HOME": str(work / "prefect")}
    try:
        first, first_wall, first_log = run_pipeline(env, str(work / "out"), args.steps, work / "first.json")
        second, second_wall, _ = run_pipeline(env, str(work / "out"), args.steps, work / "second.json")
        ppo, ppo_wall, ppo_log = run_pipeline(env, str(work / "out"), None, work / "ppo.json", PPO)
    finally:
        head.stop()
        remove_home(head)
    embedded = {k: v for k, v in env.items() if k != "ALIGNFLOW_RAY_ADDRESS"}
    embedded["ALIGNFLOW_SERVICES_HOME"] = str(work / "no-services")  # not the checkout's `services up`, if any
    # The tiny pipeline as a user first types it, with no service up: Prefect's temporary server and, beside it
    # once the run knows a stage must run, a private Ray head; new storage, so its stage runs.
    typed, typed_wall, typed_log = run_pipeline(embedded, str(work / "typed"), args.steps, work / "typed.json")
    typed_stage = typed["stages"][0]
    typed_overhead = typed_stage["seconds"] - compute_s(typed_stage)
    head_beside_prefect = typed_log.find("starting a local Ray head") < typed_log.find("Starting temporary server")
    third, third_wall, third_log = run_pipeline(embedded, str(work / "out"), args.steps, work / "third.json")
    assert all(s["cached"] for s in third["stages"]), third["stages"]
    head_started = "starting a local Ray head" in third_log
    # The case: the three-stage PPO graph, fully cached, typed as a user would (no Ray address, no Prefect
    # server: answered before either would start), and the same through Prefect's temporary server (--flow-run).
    walls = []
    for _ in range(args.repeat):
        ppo_cached, wall, cached_log = run_pipeline(embedded, str(work / "out"), None, work / "ppo2.json", PPO)
        assert all(s["cached"] for s in ppo_cached["stages"]) and "answered without Prefect" in cached_log, cached_log[-2000:]
        walls.append(wall)
    ppo_cached_wall = statistics.median(walls)
    ppo_flow, ppo_flow_wall, _ = run_pipeline(embedded, str(work / "out"), None, work / "ppo3.json", PPO, "--flow-run")
    assert all(s["cached"] for s in ppo_flow["stages"])

    # Each stage job says how its process started (infra/warm.py): forked from the head's warm server, or fresh.
    forked = sum(log.count("forked from the warm stage server") for log in (first_log, ppo_log))
    fresh = [line for log in (first_log, ppo_log) for line in log.splitlines() if "starting the stage process fresh" in line]
    rows = []
    for stage in [*first["stages"], *ppo["stages"]]:
        if stage["cached"]:
            continue
        compute = compute_s(stage)
        rows.append({"stage": stage["stage"], "task_s": stage["seconds"], "job_s": stage["job_seconds"],
                     "compute_s": compute, "overhead_s": stage["seconds"] - compute,
                     "peak_rss_mib": stage["metrics"].get("memory/peak_rss_mib")})
    cached = [{"stage": s["stage"], "cached": s["cached"], "task_s": s["seconds"]} for s in second["stages"]]
    result = {"ray_head_start_s": ray_start, "jobs_forked": forked, "jobs_fresh": fresh, "first": {"command_s": first_wall, "flow_s": first["seconds"], "stages": rows},
              "cached": {"command_s": second_wall, "flow_s": second["seconds"], "stages": cached},
              "first_as_typed": {"command_s": typed_wall, "flow_s": typed["seconds"], "stage_task_s": typed_stage["seconds"],
                                 "stage_overhead_s": typed_overhead, "ray_head_beside_prefect": head_beside_prefect},
              "cached_embedded": {"command_s": third_wall, "flow_s": third["seconds"], "ray_head_started": head_started},
              "ppo_first": {"command_s": ppo_wall, "flow_s": ppo["seconds"]},
              "ppo_cached": {"command_s": ppo_cached_wall, "command_s_each": walls, "flow_s": ppo_cached["seconds"]},
              "ppo_cached_flow_run": {"command_s": ppo_flow_wall, "flow_s": ppo_flow["seconds"]}}
    print(f"Ray head start-up: {ray_start:.1f}s; stage jobs forked from the warm server: {forked}, started fresh: {len(fresh)}")
    for line in fresh:
        print(f"  {line.strip()[-300:]}")
    print("| stage | task (s) | Ray job (s) | stage compute (s) | overhead (s) | job peak RSS (MiB) |\n|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['stage']} | {r['task_s']:.1f} | {r['job_s']:.1f} | {r['compute_s']:.1f} | {r['overhead_s']:.1f} "
              f"| {r['peak_rss_mib'] or float('nan'):.0f} |")
    print(f"first run: command {first_wall:.1f}s, flow {first['seconds']:.1f}s")
    print(f"cached re-run: command {second_wall:.1f}s, flow {second['seconds']:.1f}s, "
          f"stages cached: {[s['cached'] for s in cached]}")
    print(f"first run as typed, no service up (Prefect's temporary server, a private Ray head): command {typed_wall:.1f}s, "
          f"flow {typed['seconds']:.1f}s, sft task {typed_stage['seconds']:.1f}s (overhead {typed_overhead:.1f}s), "
          f"Ray head started beside Prefect's server: {head_beside_prefect}")
    print(f"cached re-run, no Ray address given: command {third_wall:.1f}s, flow {third['seconds']:.1f}s, "
          f"Ray head started: {head_started}")
    print(f"{PPO} first run: command {ppo_wall:.1f}s; fully cached as typed: command {ppo_cached_wall:.1f}s "
          f"(median of {len(walls)}: {', '.join(f'{w:.1f}' for w in walls)}; answered without Prefect); with --flow-run: command {ppo_flow_wall:.1f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
