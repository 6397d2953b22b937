"""The comparison table's pass@k, majority-vote and reward-model score-gap columns, and the same
metrics through a real MLflow SQLite store (stage run and parent run): names MLflow accepts."""

from __future__ import annotations

import pytest

from alignflow.config.pipeline import InfraConfig, StorageConfig
from flows.report import PipelineReport, close_run, compared
from tasks.context import RunContext
from tasks.stages.eval_metrics import margin_metrics, sample_metrics

EXPERIMENT = "alignflow-test"  # the shared `tracker` fixture's (tests/conftest.py)


def _report(policies, reward_model=None, **kw) -> PipelineReport:
    return PipelineReport(mlflow_run_id="r", mlflow_tracking_uri="sqlite:///x", storage_root="/a", stage_uris={},
                          stage_states={}, policies=policies, reward_model=reward_model or {}, **kw)


def _rows(table: str) -> dict[str, dict[str, str]]:
    lines = table.splitlines()
    cols = lines[0].split()
    return {parts[0]: dict(zip(cols[1:], parts[1:])) for parts in map(str.split, lines[2:]) if len(parts) == len(cols)}


def test_table_shows_every_pass_at_k_up_to_four_and_majority():
    sft = {"eval/accuracy": 0.25, "eval/pass_at_1": 0.25, "eval/pass_at_2": 0.4, "eval/pass_at_3": 0.5,
           "eval/pass_at_4": 0.625, "eval/majority_accuracy": 0.375}
    lines = _report({"sft": sft, "base": {"eval/accuracy": 0.0}}).table().splitlines()
    assert lines[0].split() == ["policy", "accuracy", "reward", "kl_to_reference", "response_length",
                                "pass@1", "pass@2", "pass@3", "pass@4", "majority"]
    assert lines[2].split() == ["sft", "0.250", "-", "-", "-", "0.250", "0.400", "0.500", "0.625", "0.375"]
    assert lines[3].split() == ["base", "0.000", "-", "-", "-", "-", "-", "-", "-", "-"]  # measured before pass@k


def test_table_shows_pass_at_1_and_n_beyond_four_samples():
    m = {"eval/accuracy": 0.5, **{f"eval/pass_at_{k}": k / 10 for k in range(1, 9)}, "eval/majority_accuracy": 0.75}
    rows = _rows(_report({"round_1": m}).table())
    assert rows["round_1"] == {"accuracy": "0.500", "reward": "-", "kl_to_reference": "-", "response_length": "-",
                               "pass@1": "0.100", "pass@8": "0.800", "majority": "0.750"}


def test_table_without_pass_at_k_keeps_its_columns():
    lines = _report({"sft": {"eval/accuracy": 0.25}}).table().splitlines()
    assert lines[0].split() == ["policy", "accuracy", "reward", "kl_to_reference", "response_length"]


def test_table_shows_reward_model_accuracy_per_score_gap_bin():
    rm = {"eval/rm_pairwise_accuracy": 0.75,
          **margin_metrics([2.0, 0.1, 0.0, 1.2], [1.0, 0.0, 0.3, 0.0], [0.0, 0.5, 1.0, 2.0])}
    lines = _report({"sft": {"eval/accuracy": 0.25}}, rm).table().splitlines()
    assert lines[-2] == "reward model held-out pairwise accuracy: 0.750"
    assert lines[-1] == ("reward model accuracy by |chosen - rejected| score gap: "
                         "[0,0.5) 0.500 (n=2)  [0.5,1) - (n=0)  [1,2) 1.000 (n=2)  [2,inf) - (n=0)")


def test_table_shows_the_judges_verdict_accuracy_and_its_unparsed_verdicts():
    judge = {"eval/judge_verdict_accuracy": 0.955, "eval/judge_unparsed": 3.0, "eval/judge_verdicts": 400.0,
             "eval/judge_overlong": 0.0}
    lines = _report({"sft": {"eval/accuracy": 0.25}}, judge=judge).table().splitlines()
    assert lines[-1] == "judge held-out verdict accuracy: 0.955 (3 of 400 verdicts unparsed)"
    assert not any("judge" in line for line in _report({"sft": {"eval/accuracy": 0.25}}).table().splitlines())


def test_table_shows_the_process_reward_models_accuracies_beside_the_share_labelled_right():
    prm = {"eval/prm_step_accuracy": 0.957, "eval/prm_positive_fraction": 0.795, "eval/prm_solution_accuracy": 0.88,
           "eval/prm_first_error_accuracy": 0.87, "eval/prm_steps": 1000.0, "data/eval_process_rows": 200.0}
    lines = _report({"sft": {"eval/accuracy": 0.25}}, process_reward_model=prm).table().splitlines()
    assert lines[-1] == ("process reward model held-out accuracy: steps 0.957 (labelled right: 0.795), solutions "
                         "0.880, first wrong step 0.870")
    assert not any("process" in line for line in _report({"sft": {"eval/accuracy": 0.25}}).table().splitlines())


def test_the_metrics_reach_mlflow_under_the_stage_and_the_parent_run(tracker, tmp_path):
    from mlflow import MlflowClient

    policy = {"eval/accuracy": 1 / 3, **sample_metrics([0, 0, 1, 1], ["a", "a", "b", "c"], [True, True, False, True],
                                                       num_prompts=2, num_samples=2)}
    rm = margin_metrics([1.0, 3.0], [0.0, 0.5], [0.0, 0.5, 1.0, 2.0])
    parent = tracker.start_parent("pipeline", {})
    for stage, metrics in (("eval_sft", policy), ("eval_reward_model", rm)):
        with tracker.stage_run(parent, stage, {}, tags={"alignflow.key": f"{stage}-{parent}"}) as run:
            run.log_metrics(metrics)  # as the evaluation stages do: MLflow validates every name
    infra = InfraConfig(mlflow_tracking_uri=tracker.tracking_uri, mlflow_experiment=EXPERIMENT,
                        storage=StorageConfig(root=str(tmp_path)))
    report = PipelineReport(mlflow_run_id=parent, mlflow_tracking_uri=tracker.tracking_uri, storage_root=str(tmp_path),
                            stage_uris={}, stage_states={}, policies={"sft": policy}, reward_model=rm)
    close_run(RunContext(infra=infra, parent_run_id=parent), report)

    logged = MlflowClient(tracking_uri=tracker.tracking_uri).get_run(parent).data.metrics
    # prompt 0: c=2 of 2; prompt 1: c=1 of 2 -> pass@1 = (1 + 1/2)/2 = 0.75, pass@2 = (1 + 1)/2 = 1
    # majority: prompt 0 "a" right; prompt 1 tie "b" (first) wrong -> 0.5
    assert {k: v for k, v in logged.items() if k.startswith("sft/")} == {
        "sft/accuracy": 1 / 3, "sft/pass_at_1": 0.75, "sft/pass_at_2": 1.0, "sft/majority_accuracy": 0.5}
    # gaps 1.0 (right) in [1,2), 2.5 (right) in [2,inf)
    assert {k: v for k, v in logged.items() if "margin_" in k} == {
        "rm_count_margin_0_0.5": 0.0, "rm_count_margin_0.5_1": 0.0, "rm_count_margin_1_2": 1.0,
        "rm_accuracy_margin_1_2": 1.0, "rm_count_margin_2_inf": 1.0, "rm_accuracy_margin_2_inf": 1.0}


def test_policies_evaluated_as_agents_get_their_episode_columns_and_others_a_dash():
    agent = {"eval/accuracy": 0.75, "eval/turns_per_episode": 1.9375, "eval/tool_calls_per_episode": 1.0325,
             "eval/invalid_calls_per_episode": 0.055, "eval/truncated_fraction": 0.04375, "eval/failed_fraction": 0.0}
    rows = _rows(_report({"sft": {"eval/accuracy": 0.17}, "round_1": agent}).table())
    assert {k: rows["round_1"][k] for k in ("turns", "tool_calls", "invalid_calls", "truncated", "failed")} == {
        "turns": "1.938", "tool_calls": "1.032", "invalid_calls": "0.055", "truncated": "0.044", "failed": "0.000"}
    assert rows["sft"]["turns"] == "-"
    assert "turns" not in _report({"sft": {"eval/accuracy": 0.17}}).table()
    assert compared("eval/tool_calls_per_episode") and not compared("eval/cut_turns_per_episode")


@pytest.mark.parametrize("raised, status", [(RuntimeError("the engine host did not start"), "FAILED"),
                                            (KeyboardInterrupt(), "KILLED")])
def test_a_parent_run_is_ended_by_whatever_raises_between_its_opening_and_closing(tracker, tmp_path, raised, status):
    """Outside the wait for the stages (publishing the plan, the engine host, the report, the curves) a failure
    or a stop left the parent run RUNNING, reaped only by a later run on the same host."""
    from mlflow import MlflowClient

    from flows.report import parent_closed_on_error

    parent = tracker.start_parent("pipeline", {})
    infra = InfraConfig(mlflow_tracking_uri=tracker.tracking_uri, mlflow_experiment=EXPERIMENT,
                        storage=StorageConfig(root=str(tmp_path)))
    with pytest.raises(type(raised)):
        with parent_closed_on_error(RunContext(infra=infra, parent_run_id=parent)):
            raise raised
    assert MlflowClient(tracking_uri=tracker.tracking_uri).get_run(parent).info.status == status


def test_the_cached_runs_report_ends_its_parent_run_on_an_error(tracker, tmp_path):
    """`alignflow run` of a plan that is all Cached reports from the manifests, outside any flow: a manifest that
    could not be read (or Ctrl-C while the curves draw) left its parent run RUNNING."""
    from mlflow import MlflowClient

    from alignflow.config import load_config
    from alignflow.store.faults import StorageError
    from flows.report import report_from_storage
    from tasks.plan import plan_pipeline

    cfg = load_config(None, [f"infra.mlflow_tracking_uri={tracker.tracking_uri}",
                             f"infra.mlflow_experiment={EXPERIMENT}", f"infra.storage.root={tmp_path / 'artifacts'}",
                             "name=cached-report"])
    with pytest.raises(StorageError):  # nothing committed under this root: the first manifest is missing
        report_from_storage(cfg, plan_pipeline(cfg))
    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    [run] = [r for r in client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
             if r.info.run_name.startswith("cached-report-")]
    assert run.info.status == "FAILED"


def test_a_kl_not_measured_is_neither_within_nor_over_its_budget():
    report = _report({"round_1": {"eval/accuracy": 0.5, "eval/kl_to_reference": float("nan")}, "round_2": {}})
    report.kl_budgets = {"round_1": 3.0, "round_2": 2.0}
    assert [line for line in report.table().splitlines() if "KL to reference" in line] == [
        "round_1: KL to reference not measured (budget 3)", "round_2: KL to reference not measured (budget 2)"]


def test_a_parent_run_that_cannot_be_ended_leaves_the_first_error_to_be_raised(tmp_path):
    """Where MLflow is what failed, ending the parent run fails too: that is logged, and the error that stopped
    the run (a stop included) is the one raised, not MLflow's."""
    from flows.report import parent_closed_on_error

    infra = InfraConfig(mlflow_tracking_uri=f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'mlflow.db'}",
                        storage=StorageConfig(root=str(tmp_path)))
    with pytest.raises(KeyboardInterrupt):
        with parent_closed_on_error(RunContext(infra=infra, parent_run_id="0" * 32)):
            raise KeyboardInterrupt
