"""`alignflow`: run, validate and inspect pipelines.

    alignflow run [CONFIG.yaml] [key.sub=value ...]
    alignflow validate [CONFIG.yaml] [key.sub=value ...]
    alignflow stage NAME [CONFIG.yaml] [key.sub=value ...]

Config is validated before anything starts. For a run, the CLI makes sure
one Prefect API serves the flow and every Ray worker (see flows/runtime.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from alignflow.cluster import apply_process_env
from alignflow.config import ConfigError, PipelineConfig, load_config, resolve_paths


def _split_args(items: list[str]) -> tuple[str | None, list[str]]:
    path = None
    overrides = []
    for item in items:
        if "=" in item:
            overrides.append(item)
        elif path is None:
            path = item
        else:
            raise ConfigError(f"unexpected argument {item!r}: one config file, then key.sub=value overrides")
    return path, overrides


def _load(items: list[str]) -> PipelineConfig:
    path, overrides = _split_args(items)
    return resolve_paths(load_config(path, overrides))


def cmd_validate(cfg: PipelineConfig) -> int:
    print(cfg.model_dump_json(indent=2))
    print("config is valid", file=sys.stderr)
    return 0


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "fix your input": printed as one line, exit code 2."""
    from alignflow.data.formats import DataError
    from engines.batches import PromptTooLongError
    from engines.rl import InsufficientResourcesError

    return (ConfigError, DataError, PromptTooLongError, InsufficientResourcesError)


def cmd_run(cfg: PipelineConfig, stage: str | None = None) -> int:
    try:
        return _run(cfg, stage)
    except _user_errors() as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _warm_up(cfg: PipelineConfig) -> None:
    """Start Ray and import the flows while the Prefect API starts (the task
    runner reuses an initialised Ray, and shuts it down only if it started it)."""
    import ray

    from alignflow.cluster import ray_init_kwargs

    ray.init(**ray_init_kwargs(cfg.infra))
    import flows.pipeline  # noqa: F401  (prefect, mlflow, torch: seconds of imports)
    import flows.stages  # noqa: F401


def _run(cfg: PipelineConfig, stage: str | None) -> int:
    import ray

    from flows.runtime import prefect_api, ray_task_runner

    apply_process_env()
    t0 = time.perf_counter()
    log_dir = Path(cfg.infra.storage.root if "://" not in cfg.infra.storage.root else ".") / "logs"
    with prefect_api(cfg.infra, log_dir, while_starting=lambda: _warm_up(cfg)) as url:
        print(f"Prefect API: {url}", file=sys.stderr)
        if stage:
            from flows import stages

            flow_fn = stages.STAGE_FLOWS[stage]
        else:
            from flows.pipeline import pipeline as flow_fn
        try:
            result = flow_fn.with_options(task_runner=ray_task_runner(cfg.infra))(cfg)
        finally:
            # Ship buffered run logs while the API is still up.
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all()
            ray.shutdown()
    elapsed = time.perf_counter() - t0
    if stage:
        print(result.model_dump_json(indent=2))
    else:
        _print_report(result, elapsed)
    return 0


def _print_report(report, elapsed: float) -> None:
    print()
    print(report.table())
    print()
    print("stages:")
    for name, uri in report.stage_uris.items():
        print(f"  {name:<18} {report.stage_states.get(name, ''):<10} {uri}")
    print(f"artifacts:  {report.storage_root}")
    print(f"MLflow:     {report.mlflow_tracking_uri}  (parent run {report.mlflow_run_id})")
    print(f"            view with: mlflow ui --backend-store-uri {report.mlflow_tracking_uri}")
    print(f"wall time:  {elapsed:.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="alignflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "validate"):
        p = sub.add_parser(name)
        p.add_argument("args", nargs="*", help="[CONFIG.yaml] [key.sub=value ...]")
    p = sub.add_parser("stage", help="run one stage (and, from cache, what it needs)")
    p.add_argument("name")
    p.add_argument("args", nargs="*")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = _load(ns.args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if ns.command == "validate":
        return cmd_validate(cfg)
    return cmd_run(cfg, stage=ns.name if ns.command == "stage" else None)


if __name__ == "__main__":
    sys.exit(main())
