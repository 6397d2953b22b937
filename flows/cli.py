"""`alignflow`: plan, run and inspect pipelines.

    alignflow plan [CONFIG.yaml] [key.sub=value ...]           the graph: each stage, its key, Cached or why it runs
    alignflow run [CONFIG.yaml] [key.sub=value ...]            the whole pipeline (its plan printed first)
    alignflow stage TARGET [CONFIG.yaml] [key.sub=value ...]   one target and what it needs (e.g. sft, rl, round_2)
    alignflow validate [CONFIG.yaml] [key.sub=value ...]       the resolved config

Config and targets are checked before anything starts. For a run, the CLI
makes sure one Prefect API serves the flow and every Ray worker (see
flows/runtime.py). `plan` starts neither Prefect nor Ray.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

from alignflow.cluster import apply_process_env, run_scratch
from alignflow.config import PipelineConfig, load_config, resolve_paths
from alignflow.errors import ConfigError, StartError, UserError
from alignflow.interrupts import Terminated, install_sigterm_handler
from alignflow.redact import redact, redact_url
from alignflow.store.storage import is_local_uri, local_path
from flows import console
from flows.planview import StageState, format_plan, plan_states
from tasks.context import RunContext
from tasks.plan import Plan, plan_pipeline


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


def cmd_validate(cfg: PipelineConfig, path: str | None = None, overrides: list[str] | None = None) -> int:
    from alignflow.preflight import check  # data, model, lengths, rewards, storage, Ray slots: seconds

    found = check(cfg, overrides, path)
    out(json.dumps(redact(cfg.model_dump(mode="json")), indent=2))  # a URL's credentials never printed
    print("config is valid", file=sys.stderr)
    print(f"preflight: {found.checks} checks passed", file=sys.stderr)
    return 0


def print_plan(cfg: PipelineConfig, plan: Plan) -> dict[str, StageState]:
    storage = RunContext(infra=cfg.infra).storage()
    states = plan_states(plan, storage)
    out(format_plan(plan, states, storage.uri()))
    return states


def _warm_up(cfg: PipelineConfig, verbose: bool) -> None:
    """Start Ray and make the flow ready (`_prepare_flow`) while the Prefect API starts (the task runner reuses
    an initialised Ray, and shuts it down only if it started it). One after the other: on a busy machine Ray's
    node has a fixed 30 s to start (alignflow/cluster.py `init_ray`), so nothing of this process competes."""
    import ray

    from alignflow.cluster import init_ray, ray_init_kwargs

    from flows.runtime import check_api_reachable

    kwargs = ray_init_kwargs(cfg.infra)
    if not verbose:
        console.quiet_ray_notices()
    try:
        init_ray(**kwargs, logging_level=logging.INFO if verbose else logging.WARNING)
    except Exception as err:
        where = f"the Ray cluster at {cfg.infra.ray_address}" if cfg.infra.ray_address else "a local Ray"
        logs = Path(tempfile.gettempdir()) / "ray" / "session_latest" / "logs"
        raise StartError(f"{where} did not start: {type(err).__name__}: {err} (Ray's logs: {logs})") from err
    try:
        from flows.stage_tasks import wait_for_stage_worker, warm_a_stage_worker

        # On a cluster (infra.ray_address) a no-CPU task may land on any node, not where the stages will run.
        warming = None if cfg.infra.ray_address else warm_a_stage_worker()
        check_api_reachable(cfg.infra)
        _prepare_flow(cfg)
        if warming is not None:
            wait_for_stage_worker(warming)
    except BaseException:
        ray.shutdown()  # leave the cluster before the CLI exits on the error
        raise


def _prepare_flow(cfg: PipelineConfig) -> None:
    """What the flow needs in this process before its first stage, done before the flow starts (while the
    Prefect API may still be starting): the flows imported (Prefect, MLflow), the run's MLflow store opened
    where it is a SQLite file (a new file's tables made, 3-4 s of CPU: the flow's parent run, flows/report.py
    open_run, then finds it open), and the modules the run's engine host is started with (torch) and its
    curves are drawn with. A server's store is left to the flow, which reports its errors as the run's."""
    import flows.pipeline  # noqa: F401  (prefect, mlflow: seconds of imports)
    from alignflow.tracking.params import sqlite_file
    from tasks.context import RunContext
    from tasks.stages.eval_engine import load_host_modules

    uri = cfg.infra.mlflow_tracking_uri
    if sqlite_file(uri) is not None:
        try:
            RunContext(infra=cfg.infra).tracker()
        except Exception as err:  # preflight probed its directory: not a database, locked, a newer schema
            first = (str(err).strip().splitlines() or [""])[0]  # SQLAlchemy's run on for lines
            raise StartError(f"the MLflow store {uri} did not open: {type(err).__name__}: {first}") from err
    load_host_modules()  # torch
    import matplotlib.figure  # noqa: F401  (the learning curves, drawn as the run ends: flows/curves.py)


def _run(cfg: PipelineConfig, target: str | None, verbose: bool = False, all_cached: bool = False) -> int:
    t0 = time.perf_counter()
    if all_cached and not target:  # nothing would compute: no Prefect flow run, no Ray
        from flows.report import report_from_storage

        print("every stage is committed: the report comes from the storage root (no Prefect or Ray started)",
              file=sys.stderr)
        _print_report(report_from_storage(cfg, plan_pipeline(cfg)), time.perf_counter() - t0, verbose)
        return 0
    apply_process_env()
    root = cfg.infra.storage.root
    # Beside the artifacts; for a remote root in this user's state directory (never the working directory).
    log_dir = local_path(root) / "logs" if is_local_uri(root) else \
        Path(os.environ.get("XDG_STATE_HOME") or "~/.local/state").expanduser() / "alignflow" / "logs"
    log_file = console.log_to_file(log_dir)
    print(f"log: {log_file}", file=sys.stderr)
    with run_scratch():  # the stages' scratch files, under one directory removed however the run ends
        result = _flow_run(cfg, target, log_dir, verbose)
    elapsed = time.perf_counter() - t0
    if target:  # each stage the target names (`evaluation`: every evaluation), by name
        out(json.dumps({name: r.model_dump(mode="json") for name, r in result.items()}, indent=2))
    else:
        _print_report(result, elapsed, verbose)
    return 0


def _flow_run(cfg: PipelineConfig, target: str | None, log_dir: Path, verbose: bool):
    """The pipeline's (or the target's) flow run, with a Prefect API and Ray up for it; its result."""
    import ray

    from flows.runtime import prefect_api

    with prefect_api(cfg.infra, log_dir, while_starting=lambda: _warm_up(cfg, verbose)) as url:
        logging.getLogger("alignflow").info("Prefect API: %s", url)
        from flows.pipeline import partial_pipeline, pipeline
        from flows.progress import ProgressWatcher

        try:
            with ProgressWatcher(cfg.infra.mlflow_tracking_uri, cfg.infra.mlflow_experiment):
                return partial_pipeline(cfg, target) if target else pipeline(cfg)
        finally:
            # Ship buffered run logs while the API is still up.
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all()
            ray.shutdown()


class ReaderGone(Exception):
    """stdout's reader closed it before all was written (`alignflow plan | head`): what it read was enough."""


def out(text: str) -> None:
    """`text` to stdout, flushed; a closed pipe raises ReaderGone (main returns 0 on it), stdout then sent to
    /dev/null so that Python's own flush at exit finds nothing to fail on. A BrokenPipeError from anywhere
    else (a stage's connection) is that stage's error, not this."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise ReaderGone from None


def _print_report(report, elapsed: float, verbose: bool = False) -> None:
    lines = ["", report.table(), ""]
    if verbose:
        lines.append("stages:")
        for name, uri in report.stage_uris.items():
            lines.append(f"  {name:<18} {report.stage_states.get(name, ''):<10} {uri}")
    else:
        counts = Counter(report.stage_states.values())
        lines.append(f"stages:     {', '.join(f'{n} {state}' for state, n in counts.items())}; each under "
                     f"<artifacts>/<stage>/<key> (keys in the plan above; -v lists them)")
    lines.append(f"artifacts:  {report.storage_root}")
    tracking = redact_url(report.mlflow_tracking_uri)  # a database URI's password stays out of the job's log
    lines.append(f"MLflow:     {tracking}  (parent run {report.mlflow_run_id})")
    if report.mlflow_served:
        lines.append(f"            {report.mlflow_link()}")
    else:
        lines.append(f"            mlflow ui --backend-store-uri {tracking}, then {report.mlflow_link()}")
    if report.curves_uri:
        lines.append(f"curves:     {report.curves_uri}  (loss, rounds, eval .png)")
    lines.append(f"wall time:  {elapsed:.1f} s")
    out("\n".join(lines))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="alignflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    loud = "every log line on the console (default: alignflow's, and warnings once)"
    parser.add_argument("-v", "--verbose", action="store_true", help=loud)  # before the command, or after it:
    sub = parser.add_subparsers(dest="command", required=True)
    verbose = argparse.ArgumentParser(add_help=False)  # SUPPRESS: a command without -v keeps the one before it
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=loud)
    for name in ("run", "plan", "validate"):
        p = sub.add_parser(name, parents=[verbose])
        p.add_argument("args", nargs="*", help="[CONFIG.yaml] [key.sub=value ...]")
    p = sub.add_parser("stage", parents=[verbose], help="run one target (and, from cache, what it needs)")
    p.add_argument("name", help="a stage (sft, round_2, eval_sft, ...) or a target (data, sft, reward_model, rl, ...)")
    p.add_argument("args", nargs="*", default=[], help="[CONFIG.yaml] [key.sub=value ...]")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    if not (sys.argv[1:] if argv is None else argv):  # a bare `alignflow`: what it does, not a usage error
        parse_args(["--help"])
    ns = parse_args(argv)
    install_sigterm_handler()  # SIGTERM raises Terminated: `finally` blocks end MLflow runs KILLED, drop scratch
    console.setup(ns.verbose)
    target = ns.name if ns.command == "stage" else None
    cfg: PipelineConfig | None = None
    try:
        path, overrides = _split_args(ns.args)
        cfg = _load(ns.args)
        if ns.command == "validate":
            return cmd_validate(cfg, path, overrides)
        plan = plan_pipeline(cfg)
        states = print_plan(cfg, plan.upto(target) if target else plan)
        if ns.command == "plan":
            print("inputs not checked (data files, model, rewards, storage): `alignflow validate` checks them",
                  file=sys.stderr)
            return 0
        all_cached = all(s.cached for s in states.values())
        if not all_cached:  # what the run needs from outside, before Prefect or Ray start
            from alignflow.preflight import check

            check(cfg, overrides, path)
        return _run(cfg, target, ns.verbose, all_cached=all_cached)
    except UserError as err:
        if ns.verbose:
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr)
        return 2
    except StartError as err:
        if ns.verbose:
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr)
        return 1
    except ReaderGone:  # `alignflow plan | head`: the reader has what it wanted
        return 0
    except (KeyboardInterrupt, Terminated) as stop:
        if ns.verbose:
            traceback.print_exc()
        print(interrupted_line(cfg, ns.command, target), file=sys.stderr)
        return stop.code if isinstance(stop, Terminated) else 130


def interrupted_line(cfg: PipelineConfig | None, command: str, target: str | None) -> str:
    """What a Ctrl-C or SIGTERM stopped, in one line: each stage it stopped at its step, and how to go on. The stages'
    MLflow runs are KILLED by then (flows/report.py wait_all)."""
    again = f"alignflow {command}" + (f" {target}" if target else "")
    stopped = []
    try:
        from flows.report import opened_parent_runs

        parents = opened_parent_runs()
        if cfg is not None and parents:
            from alignflow.tracking.runs import Tracker

            runs = Tracker(cfg.infra.mlflow_tracking_uri, cfg.infra.mlflow_experiment).stage_runs(parents[-1])
            stopped = [r for r in runs if r["status"] == "KILLED"]
    except Exception as err:  # noqa: BLE001  (the line must come, whatever MLflow says)
        logging.getLogger("alignflow").warning("could not read what the interrupt stopped: %s", err)
    if not stopped:
        return f"interrupted before a stage was under way; {again} starts again"
    parts = [f"{r['stage']} stopped" + (f" at step {r['step']} of {r['total']}" if r["total"] else "") for r in stopped]
    return f"interrupted: {', '.join(parts)}; {again} resumes {'it' if len(parts) == 1 else 'them'}"


if __name__ == "__main__":
    sys.exit(main())
