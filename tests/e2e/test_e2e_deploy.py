"""prefect.yaml deploys against a real Prefect server, and the nightly
deployment is scheduled.

A `prefect server start --host 127.0.0.1` of its own (own PREFECT_HOME), the
work pool from deployments/work-pool.md, then `prefect deploy --all` from the
repository, as the header of prefect.yaml says. Offline: nothing is pulled or
pushed (build/push are null; pull only sets the working directory).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))
EXPECTED = {
    "alignflow-scheduled-pipeline/nightly", "alignflow-scheduled-pipeline/pipeline",
    "alignflow-stage/data", "alignflow-stage/base-model", "alignflow-stage/sft", "alignflow-stage/reward-model",
    "alignflow-stage/preference", "alignflow-stage/rl-rounds", "alignflow-stage/evaluation",
}


@pytest.fixture
def prefect_server(tmp_path, monkeypatch):
    """(api url, env) of a Prefect server of its own (own PREFECT_HOME), started
    the way the CLI starts one (flows.runtime.prefect_api)."""
    from alignflow.config import InfraConfig
    from flows.runtime import prefect_api

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect_home"))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)  # prefect_api sets it; undone after the test
    with prefect_api(InfraConfig(), tmp_path) as url:
        env = {**os.environ, "COLUMNS": "250", "ALIGNFLOW_HOME": str(REPO)}
        yield url, env


def _run(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    res = subprocess.run(args, env=env, cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, f"{' '.join(args)} -> {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


def test_prefect_yaml_deploys_and_nightly_is_scheduled(prefect_server):
    url, env = prefect_server
    _run([PREFECT, "work-pool", "create", "alignflow-process", "--type", "process"], env)
    _run([PREFECT, "deploy", "--all"], env, timeout=600)

    listed = _run([PREFECT, "deployment", "ls"], env).stdout
    missing = [name for name in EXPECTED if name not in listed]
    assert not missing, f"not listed: {missing}\n{listed}"

    from alignflow.config import load_config
    from tasks.plan import plan_pipeline

    deployments = {}
    for name in EXPECTED:
        out = _run([PREFECT, "deployment", "inspect", name, "--output", "json"], env).stdout
        deployments[name] = json.loads(out[out.index("{"):])
    for name, d in deployments.items():
        assert d["work_pool_name"] == "alignflow-process", name
        assert d["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
        params = d["parameters"]
        cfg = load_config(REPO / params["config_path"], params.get("overrides") or [])  # the config is valid
        if d["entrypoint"].endswith(":run_stage"):
            assert plan_pipeline(cfg).resolve(params["stage"]), f"{name}: no stages for {params['stage']!r}"

    nightly = deployments["alignflow-scheduled-pipeline/nightly"]
    assert [(s["schedule"].get("cron"), s["schedule"].get("timezone"), s["active"]) for s in nightly["schedules"]] \
        == [("0 3 * * *", "UTC", True)]
    assert all(not d["schedules"] for name, d in deployments.items() if not name.endswith("/nightly"))

    # The server's scheduler turns the cron into scheduled runs (it does not
    # with SQLAlchemy 2.1, see STACK.md).
    probe = f"""
import asyncio, json
from prefect.client.orchestration import get_client
async def main():
    async with get_client() as c:
        runs = await c.read_flow_runs()
        print(json.dumps([[str(r.deployment_id), r.state_name, r.expected_start_time.isoformat()] for r in runs]))
asyncio.run(main())
"""
    deadline = time.monotonic() + 120
    while True:
        runs = json.loads(_run([sys.executable, "-c", probe], env).stdout.strip().splitlines()[-1])
        scheduled = [r for r in runs if r[0] == nightly["id"] and r[1] == "Scheduled"]
        if scheduled or time.monotonic() > deadline:
            break
        time.sleep(5)
    assert scheduled, f"no scheduled runs of the nightly deployment: {runs}"
    assert all("T03:00:00" in r[2] for r in scheduled), scheduled
