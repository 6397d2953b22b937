"""The pipeline's MLflow parent run and its closing report."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from alignflow.config import PipelineConfig
from alignflow.records import StageResult
from tasks.context import RunContext
from tasks.plan import StageKeys

POLICY_METRICS = ("eval/accuracy", "eval/reward", "eval/kl_to_reference", "eval/response_length")


class PipelineReport(BaseModel):
    """What a pipeline run produced: where things are and how policies compare."""

    mlflow_run_id: str
    mlflow_tracking_uri: str
    storage_root: str
    stage_uris: dict[str, str]
    stage_states: dict[str, str]
    policies: dict[str, dict[str, float]]
    reward_model: dict[str, float]
    kl_budgets: dict[str, float] = {}

    def table(self) -> str:
        cols = ["policy", *[m.removeprefix("eval/") for m in POLICY_METRICS]]
        rows = [cols] + [
            [name, *(f"{m.get(k, float('nan')):.3f}" for k in POLICY_METRICS)] for name, m in self.policies.items()
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        acc = self.reward_model.get("eval/rm_pairwise_accuracy", float("nan"))
        lines.append(f"reward model held-out pairwise accuracy: {acc:.3f}")
        for name, budget in self.kl_budgets.items():
            kl = self.policies.get(name, {}).get("eval/kl_to_reference", float("nan"))
            verdict = "within" if kl <= budget else "OVER"
            lines.append(f"{name}: KL to reference {kl:.3f} {verdict} budget {budget:g}")
        return "\n".join(lines)


def start_pipeline_run(config: PipelineConfig, keys: StageKeys) -> RunContext:
    from prefect.runtime import flow_run

    tracker = RunContext(infra=config.infra).tracker()
    run_id = tracker.start_parent(
        run_name=f"{config.name}-{flow_run.name or 'local'}",
        params=config.model_dump(mode="json"),
        tags={"alignflow.prefect_flow_run_id": str(flow_run.id or ""), **{f"alignflow.key.{k}": str(v)
              for k, v in keys.model_dump().items() if isinstance(v, str)}},
    )
    return RunContext(infra=config.infra, parent_run_id=run_id)


def finish_pipeline_run(ctx: RunContext, *, stages: dict[str, Any], policy_evals: dict[str, Any], rm_eval: Any,
                        kl_budgets: dict[str, float] | None = None) -> PipelineReport:
    """Wait for every future, log the comparison to the parent run, close it."""
    tracker = ctx.tracker()
    futures = {**stages, **{f"eval_{n}": f for n, f in policy_evals.items()}, "eval_reward_model": rm_eval}
    try:
        results: dict[str, StageResult] = {name: f.result() for name, f in futures.items()}
    except BaseException:
        tracker.finish(ctx.parent_run_id, status="FAILED")
        raise
    states = {name: f.state.name for name, f in futures.items()}
    report = PipelineReport(
        mlflow_run_id=ctx.parent_run_id,
        mlflow_tracking_uri=ctx.infra.mlflow_tracking_uri,
        storage_root=ctx.storage().uri(),
        stage_uris={name: r.uri for name, r in results.items()},
        stage_states=states,
        policies={name: results[f"eval_{name}"].metrics for name in policy_evals},
        reward_model=results["eval_reward_model"].metrics,
        kl_budgets=kl_budgets or {},
    )
    from mlflow import MlflowClient
    from mlflow.entities import Metric
    import time

    now = int(time.time() * 1000)
    metrics = [Metric(f"{name}/{k.removeprefix('eval/')}", v, now, 0)
               for name, m in report.policies.items() for k, v in m.items() if k in POLICY_METRICS]
    metrics += [Metric(k.removeprefix("eval/"), v, now, 0) for k, v in report.reward_model.items()]
    client = MlflowClient(ctx.infra.mlflow_tracking_uri)
    client.log_batch(ctx.parent_run_id, metrics=metrics)
    client.log_text(ctx.parent_run_id, report.table(), "report.txt")
    tracker.finish(ctx.parent_run_id)
    return report
