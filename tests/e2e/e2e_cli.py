"""What the end-to-end tests read from the `alignflow` CLI: its stages block, its table, its JSON, and the
MLflow runs it made (tests/e2e/test_e2e_*.py import it by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

UPSTREAM = ("data", "base_model", "sft", "reward_model")
BASE_STAGES = {*UPSTREAM, "eval_base", "eval_sft", "eval_reward_model"}


# ---- reading what the CLI printed -------------------------------------------------


def parse_stages(stdout: str) -> dict[str, tuple[str, str]]:
    """The `stages:` block -> {stage: (state, uri)}."""
    lines = stdout.splitlines()
    assert "stages:" in lines, f"no 'stages:' block in:\n{stdout[-3000:]}"
    stages = {}
    for line in lines[lines.index("stages:") + 1 :]:
        if not line.startswith("  "):
            break
        parts = line.split()
        assert len(parts) == 3, f"stage line without a state: {line!r}"
        stages[parts[0]] = (parts[1], parts[2])
    assert stages, "empty stages block"
    return stages


def parse_table(stdout: str) -> dict[str, dict[str, float]]:
    """The comparison table -> {policy: {column: value}}."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["policy"])
    cols = lines[header].split()[1:]
    rows = {}
    for line in lines[header + 2 :]:
        parts = line.split()
        if not parts or parts[0] == "reward" or parts[0].endswith(":"):
            break
        rows[parts[0]] = {c: None if v == "-" else float(v) for c, v in zip(cols, parts[1:])}
    return rows


def parent_run_id(stdout: str) -> str:
    m = re.search(r"\(parent run ([0-9a-f]{32})\)", stdout)
    assert m, f"no MLflow parent run id in:\n{stdout[-2000:]}"
    return m.group(1)


def stage_json(stdout: str) -> dict:
    """`alignflow stage` prints, last, indented JSON: each stage its target names -> that stage's StageResult."""
    lines = stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if line == "{")
    return json.loads("\n".join(lines[start:]))


def mlflow_client(tracking_uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri)


def experiment_id(client) -> str:
    exp = client.get_experiment_by_name("alignflow")
    assert exp is not None, "no 'alignflow' MLflow experiment"
    return exp.experiment_id


def child_runs(client, parent_id: str) -> list:
    return client.search_runs([experiment_id(client)], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
                              max_results=1000)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stage_runs(tracking_uri: str) -> dict[str, object]:
    """{stage: its MLflow run} of a run's stages."""
    client = mlflow_client(tracking_uri)
    return {r.data.tags["alignflow.stage"]: r for r in client.search_runs([experiment_id(client)])
            if "alignflow.stage" in r.data.tags}
