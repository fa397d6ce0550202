"""`alignflow` command line."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from alignflow.config import ConfigError, dump_config, load_config
from alignflow.exit_codes import BAD_INPUT

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False,
                  help="alignflow: end-to-end LLM alignment pipelines.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect configs.")
app.add_typer(config_app, name="config")

def _version(value: bool) -> None:
    if value:
        from alignflow import __version__

        typer.echo(f"alignflow {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit")] = False) -> None:
    """alignflow: end-to-end LLM alignment pipelines."""


ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="pipeline config YAML")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="override KEY=VALUE, e.g. sft.optim.lr=1e-4")]


def _load(config: Path, overrides: list[str] | None):
    try:
        return load_config(config, overrides or [])
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(BAD_INPUT) from None


# What the run summary shows of each stage (those it has): held-out figures first.
SUMMARY_METRICS = ("eval/loss_initial", "eval/loss", "eval/accuracy", "eval/nll", "eval/pairwise_accuracy", "eval/rewards/accuracy", "eval/rewards/margin",
                   "eval/reward_initial", "eval/reward", "reward/mean", "train/kl", "data/train/used", "data/train/skipped", "data/train/filtered")


@app.command()
def stage(
    name: Annotated[str, typer.Argument(help="the stage's name in the config")],
    config: ConfigOpt,
    overrides: SetOpt = None,
    output: Annotated[Optional[str], typer.Option(help="publish here instead of the cache-keyed stage folder")] = None,
    input: Annotated[Optional[list[str]], typer.Option("--input", help="ROLE=URI: a published upstream output (roles: from, "
                                                       "reward_model, model:<stage>; default: found from the config)")] = None,
    nproc: Annotated[int, typer.Option(help="worker processes on this machine (torchrun)")] = 1,
    summary_json: Annotated[Optional[Path], typer.Option(help="write the stage summary as JSON here")] = None,
) -> None:
    """Run one stage by hand, exactly as it runs inside a Ray job."""
    cfg = _load(config, overrides)  # fail on a bad config before any process starts
    if name not in cfg.stages:
        typer.echo(f"error: no stage named {name!r} in {config} (stages: {', '.join(cfg.stages)})", err=True)
        raise typer.Exit(BAD_INPUT)
    args = ["--config", str(config), "--stage", name, *[a for o in overrides or [] for a in ("--set", o)]]
    args += ["--output", output] if output else []
    args += [a for item in input or [] for a in ("--input", item)]
    args += ["--summary-json", str(summary_json)] if summary_json else []
    if nproc > 1:
        torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
        from alignflow.infra.ports import free_port

        cmd = [torchrun, f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "alignflow.stages", *args]
        os.execv(cmd[0], cmd)
    from alignflow.stages.common.entry import run_stage_cli

    raise typer.Exit(run_stage_cli(args))


def _prefect_defaults() -> None:
    # Before prefect is imported: its temporary server needs 10-25 s to start here.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def _services_up(cfg) -> dict:
    """The services `alignflow services up` left running (a stale state file is ignored); their Prefect
    and MLflow servers become this process's unless the environment or the config names others."""
    from alignflow.infra import services

    up = {s.name: s for s in services.load_services() if s.alive()}
    if "prefect" in up and "PREFECT_API_URL" not in os.environ:
        os.environ["PREFECT_API_URL"] = up["prefect"].url
    if "mlflow" in up and not (cfg is not None and cfg.tracking.uri) and "MLFLOW_TRACKING_URI" not in os.environ:
        os.environ["MLFLOW_TRACKING_URI"] = up["mlflow"].url
    return up


@contextlib.contextmanager
def _services_for(cfg, on_demand: bool = True, needs_job: bool = False):
    """Use what is configured or already up (`alignflow services up`); else a private Ray head, stopped at the end
    and started when the first stage job is submitted (a fully cached run starts none), or in the background now
    when the run is known to need a job (`needs_job`: its start overlaps Prefect's temporary server's), or now
    unless `on_demand` (flow runs in other processes need its address)."""
    from alignflow.infra import ray_jobs, services

    up = _services_up(cfg)
    if cfg.ray.address or "ALIGNFLOW_RAY_ADDRESS" in os.environ:
        yield
    elif "ray" in up:
        os.environ["ALIGNFLOW_RAY_ADDRESS"] = up["ray"].url
        yield
    else:
        with services.ray_head_on_demand(cfg.ray.num_cpus) as head:
            if on_demand and needs_job:
                head.start_early()
            # Flow runs of a deployment (`serve`) come later: the head runs its start-up job first (start_ray_head).
            os.environ["ALIGNFLOW_RAY_ADDRESS"] = ray_jobs.ON_DEMAND if on_demand else head.url(ready_for_jobs=True)
            try:
                yield
            finally:
                os.environ.pop("ALIGNFLOW_RAY_ADDRESS", None)


@app.command()
def run(
    config_arg: Annotated[Optional[Path], typer.Argument(metavar="CONFIG", help="pipeline config YAML")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="pipeline config YAML (same as CONFIG)")] = None,
    overrides: SetOpt = None,
    until: Annotated[Optional[str], typer.Option(help="run this stage and every stage it needs")] = None,
    only: Annotated[Optional[str], typer.Option(help="run this one stage; its inputs must be published already")] = None,
    summary_json: Annotated[Optional[Path], typer.Option(help="also write the run summary as JSON here")] = None,
    flow_run: Annotated[bool, typer.Option("--flow-run", help="run the Prefect flow even when every stage is published "
                                           "(by default such a run is answered without Prefect's temporary server)")] = False,
) -> None:
    """Run the config's stage graph: each stage a cached Prefect task running a Ray job."""
    path = config or config_arg
    if path is None:
        typer.echo("error: give a config: alignflow run CONFIG (or --config CONFIG)", err=True)
        raise typer.Exit(BAD_INPUT)
    cfg = _load(path, overrides)
    _prefect_defaults()
    _services_up(cfg)  # before Prefect is imported: it reads PREFECT_API_URL once, at import
    needs_job = False  # known only where the run was first tried without Prefect
    try:
        from alignflow.flows import run_record

        stages = run_record.plan(cfg, until, only)
        run_record.check_storage(cfg)
        if not flow_run and not run_record.prefect_server_configured():
            inputs = run_record.published_inputs(cfg, only) if only else {}
            cached = run_record.run_fully_cached(cfg, stages, inputs, lambda msg, *a: typer.echo(msg % a, err=True))
            if cached is not None:
                typer.echo("every stage is published: answered without Prefect (no flow run recorded; --flow-run "
                           "records one)", err=True)
                reg = cached["registered_model"]
                _finish_run(cached, summary_json, failed=bool(reg and not reg["promoted"] and cfg.registration.gate.fail))
                return
            needs_job = True  # a stage is not published: it will run as a Ray job
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(BAD_INPUT) from None
    import psutil

    from alignflow.infra import watchdog

    watchdog.start(os.getpid(), psutil.Process().create_time())  # even a SIGKILL of this process leaves nothing running
    with _services_for(cfg, needs_job=needs_job):
        from alignflow.flows.alignment import alignment

        state = alignment(str(path), overrides or [], until, only, return_state=True)
    result = state.result(raise_on_failure=False)
    if isinstance(result, BaseException):  # failed stages (named, each with the tail of its log), or --only's inputs
        typer.echo(f"error: {result}", err=True)
        raise typer.Exit(BAD_INPUT if isinstance(result, ConfigError) else 1)
    _finish_run(result, summary_json, failed=state.is_failed())


def _finish_run(result: dict, summary_json: Path | None, failed: bool) -> None:
    _print_summary(result)
    if summary_json:
        summary_json.write_text(json.dumps(result, indent=2))
    if failed:
        raise typer.Exit(1)


def _print_summary(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 160))
    table = Table(title=f"alignflow '{result['name']}' in {result['seconds']:.1f}s")
    for col in ("stage", "kind", "cache", "seconds", "main metrics", "published at"):
        table.add_column(col, overflow="fold")
    for st in result["stages"]:
        main = {k: v for k, v in st["metrics"].items() if k in SUMMARY_METRICS and (v or not k.startswith("data/"))}
        table.add_row(st["stage"], st["kind"], "hit" if st["cached"] else "run", f"{st['seconds']:.1f}",
                      ", ".join(f"{k}={v:.4g}" for k, v in main.items()), st["uri"])
    console.print(table)
    for name, models in (result.get("eval") or {}).items():
        metrics = sorted({m for row in models.values() for m in row})
        evals = Table(title=f"eval stage '{name}'")
        for col in ("model", *metrics):
            evals.add_column(col)
        for model, row in models.items():
            evals.add_row(model, *[f"{row[m]:.4g}" if m in row else "-" for m in metrics])
        console.print(evals)
    console.print(f"MLflow parent run: {result['mlflow']['parent_run']}")
    reg = result.get("registered_model")
    if reg and reg["promoted"]:
        console.print(f"Registered model: {reg['name']} version {reg['version']} (alias {reg['alias']}) <- {reg['source']}")
    elif reg:
        console.print(f"NOT PROMOTED: {reg['name']} version {reg['version']} is registered without the candidate alias: {reg['gate']}")


services_app = typer.Typer(no_args_is_help=True, help="Local services that persist between runs.")
app.add_typer(services_app, name="services")


HomeOpt = Annotated[Optional[str], typer.Option("--home", help="folder of the services' stores and state file "
                                                "(default: $ALIGNFLOW_SERVICES_HOME, else ./outputs/services)")]


@services_app.command("up")
def services_up(
    artifacts: Annotated[str, typer.Option(help="MLflow artifact destination (folder or s3://)")] = "./outputs/mlflow-artifacts",
    home: HomeOpt = None,
) -> None:
    """Start a Ray head, a Prefect server and an MLflow server (with UIs) on 127.0.0.1. Their stores (MLflow runs
    and registry, Prefect flow runs and deployments) live under --home and outlast `services down`."""
    from alignflow.infra import services

    if any(svc.alive() for svc in services.load_services(home)):
        typer.echo("services are already up (alignflow services down first):", err=True)
        services_status(home)
        raise typer.Exit(1)
    if "://" not in artifacts:
        artifacts = str(Path(artifacts).resolve())
        Path(artifacts).mkdir(parents=True, exist_ok=True)
    keep = str(services.services_home(home))
    started = services.start_all(services.start_ray_head, lambda: services.start_prefect_server(keep=keep),
                                 lambda: services.start_mlflow_server(artifacts, keep=keep))
    services.save_services(started, home)
    services_status(home)
    typer.echo(f"stores kept in {keep}; for the prefect CLI and MLflow clients in your shell: eval \"$(alignflow services env)\"")


@services_app.command("down")
def services_down(
    home: HomeOpt = None,
    purge: Annotated[bool, typer.Option("--purge", help="also delete the stores (runs, registry, deployments)")] = False,
) -> None:
    """Stop the services `services up` started, each by its own process id; their stores are kept unless --purge."""
    from alignflow.infra import services

    for svc in services.load_services(home):
        svc.stop()
        if svc.name == "ray" or purge:  # Ray's folder is its session's temp dir: nothing in it outlives the head
            services.remove_home(svc)
        typer.echo(f"stopped {svc.name} (pid {svc.pid})")
    services.forget_services(home)
    if purge:
        shutil.rmtree(services.services_home(home), ignore_errors=True)
        typer.echo(f"deleted {services.services_home(home)}")


@services_app.command("status")
def services_status(home: HomeOpt = None) -> None:
    """Where the local services listen; `alignflow run` and `serve` in this project use them while they are up."""
    from alignflow.infra import services

    up = services.load_services(home)
    if not up:
        typer.echo("no local services (alignflow services up starts them)")
    for svc in up:
        ui = svc.url.removesuffix("/api")
        typer.echo(f"{svc.name:8s} pid {svc.pid:<8d} {ui}   log: {svc.log}")


@services_app.command("env")
def services_env(home: HomeOpt = None) -> None:
    """`export` lines for PREFECT_API_URL, MLFLOW_TRACKING_URI and ALIGNFLOW_RAY_ADDRESS: eval "$(alignflow services env)"."""
    from alignflow.infra import services

    up = [s for s in services.load_services(home) if s.alive()]
    if not up:
        typer.echo("no local services are up (alignflow services up starts them)", err=True)
        raise typer.Exit(1)
    typer.echo("\n".join(services.env_lines(up)))


@app.command()
def serve(
    config: Annotated[Optional[list[Path]], typer.Option("--config", "-c", help="a config to deploy (repeat for several; "
                                                         "default: configs/tiny*.yaml, the shipped tiny graphs)")] = None,
    overrides: SetOpt = None,
    cron: Annotated[str, typer.Option(help="example schedule, created paused")] = "0 3 * * *",
) -> None:
    """Serve one `alignment/<config file stem>` deployment per config from this process. Each deployment's parameters are the
    config's path and overrides (not a copy of the config), so the run form can change a few values."""
    paths = config or sorted(Path("configs").glob("tiny*.yaml"))
    cfgs = [_load(p, overrides) for p in paths]  # every config must be valid before anything is served
    _prefect_defaults()
    with _services_for(cfgs[0], on_demand=False):  # each deployment's flow run is a process of its own
        from prefect import serve as prefect_serve

        from alignflow.flows.alignment import alignment

        deployments = [
            alignment.to_deployment(name=path.stem, parameters={"config": str(path), "overrides": list(overrides or [])},
                                    cron=cron, paused=True, tags=["alignflow", cfg.name],
                                    description=f"{path}: {' -> '.join(cfg.order())}")
            for path, cfg in zip(paths, cfgs)
        ]
        prefect_serve(*deployments)


@app.command("reward-server")
def reward_server(
    model: Annotated[str, typer.Option(help="an rm stage's name (with --config), its published folder/URI, or a reward-model folder")],
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="the config whose published rm stage --model names")] = None,
    overrides: SetOpt = None,
    host: Annotated[str, typer.Option(help="address to bind (0.0.0.0 to serve other machines)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port (0: any free one; the URL is printed)")] = 8000,
    normalize: Annotated[bool, typer.Option(help="(s - mean) / std with the rm stage's statistics, as rl's reward.normalize")] = True,
    batch_size: Annotated[int, typer.Option(help="sequences per forward pass")] = 64,
    auth_env: Annotated[Optional[str], typer.Option(help="require `Authorization: Bearer $VAR` (the variable's name)")] = None,
) -> None:
    """Serve a reward model on the remote-reward contract: an rl stage's `reward.url: http://HOST:PORT/score`."""
    from alignflow.stages.rm.server import serve as serve_rewards

    folder = _reward_model_folder(model, _load(config, overrides) if config else None)
    try:
        server = serve_rewards(folder, host, port, normalize, batch_size, auth_env)
    except ValueError as exc:  # not a reward model, no statistics to normalise with, a missing token variable
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(BAD_INPUT) from None
    typer.echo(f"reward server: http://{host}:{server.server_address[1]}/score (model {folder})")
    sys.stdout.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def _reward_model_folder(model: str, cfg) -> str:
    """A local folder for --model: the config's published rm stage of that name, a published stage (its verified
    `model/`, downloaded once if remote), or a folder as is."""
    from alignflow.infra import manifest
    from alignflow.stages.common.models import fetch_published_model

    if cfg is not None:
        if model not in cfg.stages:
            typer.echo(f"error: --model {model!r} is not a stage of the config (stages: {', '.join(cfg.stages)})", err=True)
            raise typer.Exit(BAD_INPUT)
        from alignflow.lineage import published_uri

        uri = published_uri(cfg, model)
        if uri is None:
            typer.echo(f"error: stage {model!r} is not published for this config: run it first", err=True)
            raise typer.Exit(BAD_INPUT)
        model = uri
    published, problem = manifest.check(model)
    if problem:
        typer.echo(f"error: --model {model}: {problem}", err=True)
        raise typer.Exit(BAD_INPUT)
    if published is not None:
        return fetch_published_model(model, published.digest)
    if not Path(model, "config.json").exists():
        typer.echo(f"error: --model {model}: neither a published stage (MANIFEST.json) nor a model folder (config.json)", err=True)
        raise typer.Exit(BAD_INPUT)
    return model


@app.command()
def export(
    source: Annotated[str, typer.Argument(help="a published stage folder/URI, or models:/NAME@ALIAS or models:/NAME/VERSION")],
    dest: Annotated[str, typer.Argument(help="folder or s3:// prefix to copy the HF model to")],
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="the config whose tracking store holds the registry "
                                                   "(as `run` finds it); default: configs' default storage root ./outputs")] = None,
    overrides: SetOpt = None,
    tracking_uri: Annotated[Optional[str], typer.Option(help="MLflow tracking store of the registry (overrides the config)")] = None,
) -> None:
    """Copy a published model, verified against its manifest, to a folder or bucket for serving: the HF
    folder, MODEL_CARD.md, the base model's licence and a MANIFEST.json of what was exported."""
    from alignflow.config.base import StorageConfig
    from alignflow.infra.export import ExportError, export_model
    from alignflow.infra.tracking import TrackingSettings
    from alignflow.infra.tracking import tracking_uri as resolve_tracking

    cfg = _load(config, overrides) if config else None
    if source.startswith("models:/") and not tracking_uri:
        _services_up(cfg)
        tracking_uri = resolve_tracking(TrackingSettings(uri=cfg.tracking.uri if cfg else None, experiment="",
                                                         storage_root=cfg.storage.root if cfg else StorageConfig().root))
    try:
        files = export_model(source, dest, tracking_uri)
    except ExportError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(BAD_INPUT) from None
    typer.echo(f"exported {len(files)} files to {dest} (sha256 verified against the manifest; MANIFEST.json lists them)")


@config_app.command("show")
def config_show(config: ConfigOpt, overrides: SetOpt = None) -> None:
    """Print the resolved config and its hashes."""
    cfg = _load(config, overrides)
    typer.echo(dump_config(cfg))
    typer.echo(f"# pipeline config hash: {cfg.config_hash()}")
    for name in cfg.order():
        typer.echo(f"# {name} ({cfg.kind(name).value}) config hash: {cfg.section(name).config_hash()}")


@app.command("plan")
def plan_command(
    config: Annotated[Path, typer.Argument(metavar="CONFIG", help="pipeline config YAML")],
    overrides: SetOpt = None,
    gpu_memory_gb: Annotated[float, typer.Option(help="memory of one GPU, in GB")] = 80.0,
    workers: Annotated[int, typer.Option(help="GPUs of each stage without worker groups (sft, rm, dpo, kto), "
                                              "as `alignflow stage --nproc` runs it")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="print the figures as JSON")] = False,
) -> None:
    """Memory per GPU of each stage's roles (weights, gradients, optimizer, activations, engines), and whether it
    fits, before anything is submitted. Exits 2 when a stage does not fit."""
    from alignflow import plan

    cfg = _load(config, overrides)
    try:
        plans = plan.plan(cfg, gpu_memory_gb, workers)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(BAD_INPUT) from None
    typer.echo(plan.as_json(plans) if as_json else plan.render(plans))
    if not all(p.fits for p in plans):
        raise typer.Exit(BAD_INPUT)


@app.command("build-model")
def build_model(name: Annotated[str, typer.Argument(help="builtin:tiny or builtin:small")] = "builtin:tiny") -> None:
    """Build a built-in base model into the local cache and print its folder."""
    from alignflow.stages.common.builtin_model import resolve_builtin

    try:
        typer.echo(resolve_builtin(name))
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(BAD_INPUT) from None


if __name__ == "__main__":
    app()
