"""MLflow's UI, in a real browser, on what a run leaves in MLflow: the link the CLI prints opens the
experiment on its runs table, in the model-training view, with the parent run the pipeline made.

`mlflow ui` on a SQLite file, as the CLI's report tells the user to start it; headless Debian chromium
through playwright (tests/conftest.py mlflow_ui, browser_page)."""

from __future__ import annotations

import pytest

from alignflow.tracking.runs import Tracker
from flows.report import PipelineReport

pytestmark = pytest.mark.e2e


def test_the_printed_link_opens_the_experiment_on_its_runs(mlflow_ui, browser_page):
    uri, base = mlflow_ui
    tracker = Tracker(uri, "alignflow")
    parent = tracker.start_parent("pipeline-tiny", {"sft.learning_rate": 0.002})
    tracker.run(parent).log_metrics({"sft/accuracy": 0.4, "round_1/accuracy": 0.6})
    tracker.finish(parent)
    report = PipelineReport(mlflow_run_id=parent, mlflow_tracking_uri=uri, mlflow_experiment_id=tracker.experiment_id,
                            storage_root="./artifacts", stage_uris={}, stage_states={}, policies={})
    link = report.mlflow_link(ui=base)
    page = browser_page

    # What a user gets without the link's view: MLflow 3.17 opens the experiment on its GenAI overview.
    page.goto(f"{base}/#/experiments/{tracker.experiment_id}")
    page.wait_for_url("**/overview/**")
    assert "workflowType=genai" in page.url

    page.goto(link)
    page.get_by_text("pipeline-tiny", exact=True).wait_for()  # the runs table, with the pipeline's parent run
    assert f"/experiments/{tracker.experiment_id}/runs" in page.url and "workflowType=machine_learning" in page.url
    assert page.get_by_text("Run Name", exact=True).count() >= 1
    assert page.get_by_text("Model registry", exact=True).count() >= 1  # the training view's navigation
    assert page.get_by_text("Observability", exact=True).count() == 0  # not the GenAI one's
    page.get_by_text("pipeline-tiny", exact=True).first.click()  # its page: the rounds' metrics
    page.get_by_text("round_1/accuracy", exact=True).wait_for()
    assert page.get_by_text("sft/accuracy", exact=True).count() >= 1
