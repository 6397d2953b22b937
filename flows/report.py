"""The pipeline's MLflow parent run and its closing report."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel

from alignflow.config import PipelineConfig
from alignflow.interrupts import DeferredSignals, end_status
from alignflow.records import StageResult
from alignflow.redact import redact_url
from flows.curves import publish_curves
from flows.stage_tasks import cancel_task_runs, settled, stop_unfinished
from tasks.context import RunContext
from tasks.stages.eval_metrics import (MAJORITY_ACCURACY, PASS_AT_PREFIX, RM_ACCURACY_PREFIX, RM_COUNT_PREFIX,
                                       pass_at_key, pass_at_ks)
from tasks.plan import Plan

log = logging.getLogger("alignflow")

POLICY_METRICS = ("eval/accuracy", "eval/reward", "eval/kl_to_reference", "eval/response_length")
FLOW_RUN_TAG = "alignflow.prefect_flow_run_id"
LOCAL_MLFLOW_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default
# Policies evaluated as agents (evaluation.environment): per episode, as engines/rollout/episodes.py counts them.
AGENT_METRICS = (("eval/turns_per_episode", "turns"), ("eval/tool_calls_per_episode", "tool_calls"),
                 ("eval/invalid_calls_per_episode", "invalid_calls"), ("eval/truncated_fraction", "truncated"),
                 ("eval/failed_fraction", "failed"))
MAX_PASS_AT_COLUMNS = 4  # more k than this: the table shows pass@1 and pass@n (MLflow has every k)


def compared(key: str) -> bool:
    """A policy metric of the comparison (table and parent run)."""
    return (key in POLICY_METRICS or key.startswith(PASS_AT_PREFIX) or key == MAJORITY_ACCURACY
            or key in dict(AGENT_METRICS))


class PipelineReport(BaseModel):
    """What a pipeline run produced: where things are and how policies compare."""

    mlflow_run_id: str
    mlflow_tracking_uri: str
    mlflow_experiment_id: str = ""
    storage_root: str
    stage_uris: dict[str, str]
    stage_states: dict[str, str]
    policies: dict[str, dict[str, float]]
    reward_model: dict[str, float] = {}
    process_reward_model: dict[str, float] = {}
    judge: dict[str, float] = {}
    kl_budgets: dict[str, float] = {}
    curves_uri: str | None = None  # the learning-curve PNGs under the storage root (flows/curves.py)

    @property
    def mlflow_served(self) -> bool:
        """Whether the tracking URI is a server (its own UI), not a database `mlflow ui` shows."""
        return self.mlflow_tracking_uri.startswith(("http://", "https://"))

    def mlflow_link(self, ui: str = LOCAL_MLFLOW_UI) -> str:
        """The experiment's runs table in MLflow's UI, in its model-training view: MLflow 3.17 opens an
        experiment on its GenAI overview unless the link (or the user's own toggle) asks for
        `workflowType=machine_learning`. A tracking server is its own UI; a database is shown by
        `mlflow ui` at `ui`."""
        base = redact_url(self.mlflow_tracking_uri) if self.mlflow_served else ui  # printed: no credentials
        return f"{base.rstrip('/')}/#/experiments/{self.mlflow_experiment_id}/runs?workflowType=machine_learning"

    def columns(self) -> list[tuple[str, str]]:
        """(metric, header) of the table: POLICY_METRICS, then pass@k (every k up to
        MAX_PASS_AT_COLUMNS, else pass@1 and pass@n), majority-vote accuracy and AGENT_METRICS where measured."""
        ks = sorted({k for m in self.policies.values() for k in pass_at_ks(m)})
        ks = ks if len(ks) <= MAX_PASS_AT_COLUMNS else [ks[0], ks[-1]]
        measured = any(MAJORITY_ACCURACY in m for m in self.policies.values())
        majority = [(MAJORITY_ACCURACY, "majority")] if measured else []
        agent = [(k, h) for k, h in AGENT_METRICS if any(k in m for m in self.policies.values())]
        return [(m, m.removeprefix("eval/")) for m in POLICY_METRICS] + [(pass_at_key(k), f"pass@{k}") for k in ks] \
            + majority + agent

    def table(self) -> str:
        keys, headers = zip(*self.columns())
        cols = ["policy", *headers]
        rows = [cols] + [[name, *(f"{round(m[k], 3) + 0.0:.3f}" if k in m else "-" for k in keys)]
                         for name, m in self.policies.items()]  # + 0.0: no "-0.000" for a KL of -1e-7
        widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if "eval/rm_pairwise_accuracy" in self.reward_model:
            lines.append(f"reward model held-out pairwise accuracy: {self.reward_model['eval/rm_pairwise_accuracy']:.3f}")
        if bins := self.margin_bins():
            lines.append("reward model accuracy by |chosen - rejected| score gap: " + "  ".join(bins))
        if "eval/prm_step_accuracy" in (p := self.process_reward_model):
            lines.append(f"process reward model held-out accuracy: steps {p['eval/prm_step_accuracy']:.3f} (labelled "
                         f"right: {p['eval/prm_positive_fraction']:.3f}), solutions "
                         f"{p['eval/prm_solution_accuracy']:.3f}, first wrong step "
                         f"{p['eval/prm_first_error_accuracy']:.3f}")
        if "eval/judge_verdict_accuracy" in self.judge:
            j = self.judge
            lines.append(f"judge held-out verdict accuracy: {j['eval/judge_verdict_accuracy']:.3f} "
                         f"({j['eval/judge_unparsed']:.0f} of {j['eval/judge_verdicts']:.0f} verdicts unparsed)")
        for name, budget in self.kl_budgets.items():
            kl = self.policies.get(name, {}).get("eval/kl_to_reference", float("nan"))
            if math.isnan(kl):  # not measured, or not a number: neither within nor over
                lines.append(f"{name}: KL to reference not measured (budget {budget:g})")
                continue
            verdict = "within" if kl <= budget else "OVER"
            lines.append(f"{name}: KL to reference {kl:.3f} {verdict} budget {budget:g}")
        return "\n".join(lines)

    def margin_bins(self) -> list[str]:
        """'[lo,hi) accuracy (n=count)' per score-gap bin of the reward model, in edge order."""
        rm, bins = self.reward_model, []
        for key in rm:
            if key.startswith(RM_COUNT_PREFIX):
                label = key.removeprefix(RM_COUNT_PREFIX)
                lo, hi = label.split("_")
                acc = rm.get(RM_ACCURACY_PREFIX + label)
                bins.append((float(lo), f"[{lo},{hi}) {'-' if acc is None else f'{acc:.3f}'} (n={rm[key]:.0f})"))
        return [text for _, text in sorted(bins)]


def open_run(config: PipelineConfig, plan: Plan, in_flow: bool = True) -> RunContext:
    """The MLflow parent run of this flow run (config as params, every stage key as a tag): a retry of
    the same Prefect flow run (its Retry button) continues the parent its first attempt opened."""
    name, flow_run_id = "cached", ""
    if in_flow:
        from prefect.runtime import flow_run

        name, flow_run_id = flow_run.name or "local", str(flow_run.id or "")
    tracker = RunContext(infra=config.infra).tracker()
    run_id = tracker.start_parent(
        run_name=f"{config.name}-{name}", params=config.model_dump(mode="json"),
        tags={FLOW_RUN_TAG: flow_run_id,
              **{f"alignflow.key.{s.name}": s.key for s in plan.stages.values()}},
        reopen_tag=FLOW_RUN_TAG if flow_run_id else None,
    )
    _opened.append(run_id)
    return RunContext(infra=config.infra, parent_run_id=run_id)


_opened: list[str] = []


def opened_parent_runs() -> list[str]:
    """Parent runs opened by flows in this process, oldest first (the CLI's progress display)."""
    return list(_opened)


WAIT_SLICE_S = 0.5  # how soon a stop asked for while stages run is acted on


def wait_all(ctx: RunContext, futures: dict[str, Any]) -> tuple[dict[str, StageResult], dict[str, str]]:
    """Every stage's result and final state name; the parent run is closed FAILED if one failed,
    KILLED if the wait was interrupted (Ctrl-C, SIGTERM), and then the stages still running are stopped
    (stop_unfinished), their task runs Cancelled (cancel_task_runs) and their runs KILLED.

    A failed stage fails the run only once every other stage has ended: those that do not need it
    finish and are committed (a retry takes them from cache), those that do end NotReady.

    The wait is in slices of WAIT_SLICE_S with Ctrl-C and SIGTERM held back meanwhile (DeferredSignals), so a
    stop is raised here, between two waits, never inside Ray's."""
    try:
        with DeferredSignals() as signals:
            for f in futures.values():
                while not settled(f, WAIT_SLICE_S):
                    signals.deliver()
        results = {name: f.result() for name, f in futures.items()}
    except BaseException as exc:
        tracker, status = ctx.tracker(), end_status(exc)
        if status == "KILLED":
            stop_unfinished(futures.values())
            cancel_task_runs(futures.values())
            tracker.stop_children(ctx.parent_run_id)
        tracker.finish(ctx.parent_run_id, status=status)
        raise
    return results, {name: f.state.name for name, f in futures.items()}


def build_report(ctx: RunContext, plan: Plan, results: dict[str, StageResult],
                 states: dict[str, str]) -> PipelineReport:
    policies = {s.name.removeprefix("eval_"): results[s.name].metrics for s in plan.of_kind("evaluate_policy")}
    rm_eval, judge_eval = plan.of_kind("evaluate_reward_model"), plan.of_kind("evaluate_judge")
    prm_eval = plan.of_kind("evaluate_process_reward_model")
    return PipelineReport(
        mlflow_run_id=ctx.parent_run_id,
        mlflow_tracking_uri=ctx.infra.mlflow_tracking_uri,
        mlflow_experiment_id=ctx.tracker().experiment_id,
        storage_root=ctx.storage().uri(),
        stage_uris={name: ctx.uri(r) for name, r in results.items()},  # under the root as it is now
        stage_states=states,
        policies=policies,
        reward_model=results[rm_eval[0].name].metrics if rm_eval else {},
        judge=results[judge_eval[0].name].metrics if judge_eval else {},
        process_reward_model=results[prm_eval[0].name].metrics if prm_eval else {},
        kl_budgets={s.name: s.config.round.kl.budget for s in plan.of_kind("rl_round") if s.name in policies},
    )


@contextlib.contextmanager
def parent_closed_on_error(ctx: RunContext) -> Iterator[None]:
    """The MLflow parent run ended FAILED (KILLED on Ctrl-C, SIGTERM or a cancel) where anything between its
    opening and its closing raises: publishing the plan, the engine host's start, the report, the curves. Only
    the wait for the stages ended it, and a parent left RUNNING is reaped only by a later run on this host."""
    try:
        yield
    except BaseException as exc:
        try:
            ctx.tracker().finish(ctx.parent_run_id, status=end_status(exc))
        except Exception as err:  # noqa: BLE001  (MLflow may be what failed: the first error is the one to raise)
            log.warning("could not end the MLflow parent run %s: %s", ctx.parent_run_id, err)
        raise


def close_run(ctx: RunContext, report: PipelineReport | None = None) -> None:
    """Log the comparison (per-policy metrics, the table) to the parent run and close it.

    With a report, the learning curves are drawn too (logged to the parent
    run, copied under the storage root, their folder set as
    `report.curves_uri`); a failure to draw them is only a warning.
    """
    tracker = ctx.tracker()
    if report is not None:
        run = tracker.run(ctx.parent_run_id)
        metrics = {f"{name}/{k.removeprefix('eval/')}": v
                   for name, m in report.policies.items() for k, v in m.items() if compared(k)}
        metrics.update({k.removeprefix("eval/"): v for k, v in report.reward_model.items()})
        metrics.update({k.removeprefix("eval/"): v for k, v in report.process_reward_model.items()
                        if k.startswith("eval/prm_")})
        run.log_metrics(metrics)
        run.log_text(report.table(), "report.txt")
        report.curves_uri = publish_curves(tracker, ctx.storage(), ctx.parent_run_id)
    tracker.finish(ctx.parent_run_id)


def report_from_storage(config: PipelineConfig, plan: Plan) -> PipelineReport:
    """A pipeline whose every stage is committed: its report from the manifests, no flow run.

    Nothing would compute, so neither Prefect nor Ray is needed: the MLflow
    parent run is opened and closed here, with the table and the curves.
    """
    ctx = open_run(config, plan, in_flow=False)
    with parent_closed_on_error(ctx):  # a manifest that cannot be read, MLflow, the curves, Ctrl-C
        storage = ctx.storage()
        results = {}
        for stage in plan.stages.values():
            uri = storage.stage_uri(stage.name, stage.key)
            metrics = storage.read_manifest(uri)["meta"].get("metrics", {})
            results[stage.name] = StageResult(stage=stage.name, key=stage.key, uri=uri, metrics=metrics)
        report = build_report(ctx, plan, results, {name: "Cached" for name in results})
        close_run(ctx, report)
    return report
