"""prefect.yaml deploys against a real Prefect server, the nightly
deployment is scheduled, a deployment run whose round fails is retried
in place, and one cancelled mid-round ends Cancelled with its MLflow runs KILLED.

A `prefect server start --host 127.0.0.1` of its own (own PREFECT_HOME), the
work pool from deployments/work-pool.md, then `prefect deploy --all` from the
repository, as the header of prefect.yaml says; a `prefect worker` runs the
flow runs. Offline: nothing is pulled or pushed (build/push are null; pull
only sets the working directory).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.stage_tasks import STOPPED

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))
EXPECTED = {
    "alignflow-scheduled-pipeline/nightly", "alignflow-scheduled-pipeline/pipeline",
    "alignflow-stage/data", "alignflow-stage/base-model", "alignflow-stage/sft", "alignflow-stage/reward-model",
    "alignflow-stage/preference", "alignflow-stage/judge", "alignflow-stage/distill",
    "alignflow-stage/rl-rounds", "alignflow-stage/evaluation",
}


@pytest.fixture(scope="module")
def prefect_server(own_prefect_server, tmp_path_factory):
    """(api url, env) of a Prefect server of its own (own PREFECT_HOME), started
    the way the CLI starts one (flows.runtime.prefect_api), with prefect.yaml deployed to it."""
    with own_prefect_server(tmp_path_factory.mktemp("prefect_server")) as server:
        env = {**os.environ, **server, "COLUMNS": "250", "ALIGNFLOW_HOME": str(REPO)}
        _run([PREFECT, "work-pool", "create", "alignflow-process", "--type", "process"], env)
        _run([PREFECT, "deploy", "--all"], env, timeout=600)
        yield server["PREFECT_API_URL"], env


def _run(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    res = subprocess.run(args, env=env, cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, f"{' '.join(args)} -> {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


def test_prefect_yaml_deploys_and_nightly_is_scheduled(prefect_server):
    url, env = prefect_server
    listed = _run([PREFECT, "deployment", "ls"], env).stdout
    missing = [name for name in EXPECTED if name not in listed]
    assert not missing, f"not listed: {missing}\n{listed}"

    from alignflow.config import PipelineConfig, config_from_parameter, load_config
    from tasks.plan import plan_pipeline

    deployments = {}
    for name in EXPECTED:
        out = _run([PREFECT, "deployment", "inspect", name, "--output", "json"], env).stdout
        deployments[name] = json.loads(out[out.index("{"):])
    files = {"alignflow-scheduled-pipeline/nightly": "deployments/configs/nightly.yaml",
             "alignflow-stage/preference": "configs/dpo.yaml", "alignflow-stage/judge": "configs/judge.yaml",
             "alignflow-stage/distill": "configs/distill.yaml"}
    for name, d in deployments.items():
        assert d["work_pool_name"] == "alignflow-process", name
        assert d["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
        # The typed run form: `config` is the pipeline model, every section of it, filled from its file.
        schema = d["parameter_openapi_schema"]
        assert schema["properties"]["config"]["$ref"] == "#/definitions/PipelineConfig", name
        top = list(schema["definitions"]["PipelineConfig"]["properties"])
        assert top == list(PipelineConfig.model_fields), top
        params = d["parameters"]
        assert PipelineConfig.model_validate(params["config"]) == load_config(REPO / files.get(name, "configs/tiny.yaml"))
        cfg, _ = config_from_parameter(params["config"], params.get("overrides"))  # the config is valid
        if d["entrypoint"].endswith(":run_stage"):
            assert plan_pipeline(cfg).resolve(params["stage"]), f"{name}: no stages for {params['stage']!r}"
    print("the run form's config sections:", top)

    nightly = deployments["alignflow-scheduled-pipeline/nightly"]
    assert [(s["schedule"].get("cron"), s["schedule"].get("timezone"), s["active"]) for s in nightly["schedules"]] \
        == [("0 3 * * *", "UTC", True)]
    assert all(not d["schedules"] for name, d in deployments.items() if not name.endswith("/nightly"))
    # One nightly run at a time: a night that finds the last one running is cancelled, not stacked beside it.
    limit = nightly["global_concurrency_limit"]
    assert (limit["limit"], limit["active"]) == (1, True), limit
    assert nightly["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"
    assert all(d["global_concurrency_limit"] is None for name, d in deployments.items() if not name.endswith("/nightly"))

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


# ---- the Custom run form, in a browser -----------------------------------------------------

NEWEST_RUN = """
import asyncio, json, sys
from uuid import UUID
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
from prefect.client.schemas.sorting import FlowRunSort
async def main():
    async with get_client() as c:
        runs = await c.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[UUID(sys.argv[1])])),
                                      sort=FlowRunSort.EXPECTED_START_TIME_DESC)
        print(json.dumps([{"id": str(r.id), "parameters": r.parameters} for r in runs]))
        if sys.argv[2:] == ["delete"]:
            for r in runs:
                await c.delete_flow_run(r.id)
asyncio.run(main())
"""


def test_the_custom_run_form_shows_the_config_and_runs_what_it_shows(prefect_server, browser_page):
    """A user's path in the Prefect UI: the `pipeline` deployment's page, Run, Custom run. The form shows the
    config's sections typed (a round's algorithm is a choice among the registry's names, prefilled from
    configs/tiny.yaml); the user picks grpo and submits; the run created carries that config, and it validates."""
    from alignflow.algorithms import ALGORITHMS
    from alignflow.config import config_from_parameter

    url, env = prefect_server
    out = _run([PREFECT, "deployment", "inspect", "alignflow-scheduled-pipeline/pipeline", "--output", "json"],
               env).stdout
    deployment_id = json.loads(out[out.index("{"):])["id"]
    page = browser_page
    page.goto(f"{url.removesuffix('/api')}/deployments/deployment/{deployment_id}")
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_text("Custom run").click()
    page.get_by_text("Rounds (Optional)", exact=True).wait_for()
    labels = page.get_by_text("Algorithm (Optional)", exact=True)
    assert labels.count() == 2, "one algorithm field per round of configs/tiny.yaml"
    # The field: the label's own .p-label box (its header's parent), holding the select.
    choice = labels.first.locator("xpath=ancestor::div[contains(@class, 'p-label__header')]/..") \
        .locator(".p-select-button__control")
    assert choice.inner_text() == "ppo"
    for label in ("Learning Rate (Optional)", "Ray Address (Optional)", "Mlflow Tracking Uri (Optional)"):
        assert page.get_by_text(label, exact=True).count() >= 1, label
    choice.focus()
    page.keyboard.press("ArrowDown")  # the select opens from the keyboard (a click only focuses it)
    options = page.get_by_role("option")
    options.first.wait_for()
    assert [options.nth(i).inner_text() for i in range(options.count())] == list(ALGORITHMS)
    page.get_by_role("option", name="grpo", exact=True).click()
    assert choice.inner_text() == "grpo"
    # Submit asks the server to validate the form's values, then to create the run. The Prefect server on SQLite
    # can answer 500 "database is locked" when another of its writers commits between a request's read and its
    # write (PrefectHQ/prefect#18934; likelier the slower the machine): the UI then says "Something went wrong"
    # and keeps the form, and a user submits again. So does this test, at most twice more, saying so; a refusal
    # (4xx) or a form that is never submitted fails at once, with what the page asked and was told.
    told: list = []
    page.on("response", lambda r: ("/ui/schemas/validate" in r.url or r.url.endswith("/create_flow_run"))
            and told.append((time.monotonic(), r)))
    try:
        created = None
        for attempt in range(3):
            seen, refused = len(told), []
            page.get_by_role("button", name="Submit").click()
            deadline = time.monotonic() + 300
            while created is None and time.monotonic() < deadline:
                answers = [r for _, r in told[seen:]]
                created = next((r for r in answers if r.url.endswith("/create_flow_run") and r.ok), None)
                refused = [r for r in answers if not r.ok]
                if refused and created is None:
                    break
                page.wait_for_timeout(250)
            assert created or refused, _what_the_page_was_told(page, told, "no answer to Submit in 300 s")
            if created:
                break
            assert all(r.status >= 500 for r in refused), _what_the_page_was_told(page, told, refused[-1].text())
            print(f"Submit {attempt + 1}: the server answered {[r.status for r in refused]}; submitting again")
        assert created, _what_the_page_was_told(page, told, "three Submits, no run created")
        page.get_by_text("scheduled to start").first.wait_for(timeout=180_000)
        print("Submit:", _what_the_page_was_told(page, told, ""))
    finally:  # the run it created, deleted: the retry test's worker must find only its own run in the pool
        runs = json.loads(_run([sys.executable, "-c", NEWEST_RUN, deployment_id, "delete"], env).stdout.splitlines()[-1])
    [run] = runs
    cfg, _ = config_from_parameter(run["parameters"]["config"], run["parameters"]["overrides"])
    assert [r.algorithm for r in cfg.rounds] == ["grpo", "ppo"]
    assert cfg.sft.learning_rate == 2.0e-3  # the file's value, not the model's default


def _what_the_page_was_told(page, told: list, why: str) -> str:
    """Why no run was created from the form: the API calls behind each Submit with their times and statuses,
    the body of a refused one (`why`) and the page's toasts."""
    t0 = told[0][0] if told else 0.0
    calls = [f"{t - t0:.1f} s: {r.request.method} {r.url.split('/api', 1)[-1]} -> {r.status}" for t, r in told]
    toasts = [t.strip() for t in page.locator(".p-toast__message").all_inner_texts()]
    return "\n".join([why[:2000], *calls, f"toasts: {toasts}", f"page: {page.url}"])


# ---- a deployment run whose round fails, fixed, and retried from its own page ------------

FLAKY_RULE = '''
from pathlib import Path

from alignflow.data.synthetic import rule_reward

BROKEN = Path({marker!r})
calls = 0


def reward(prompt, response, answer):
    """Raises once 2 steps (8 prompts x 2 samples each) are scored, while the marker file exists."""
    global calls
    calls += 1
    if calls > 32 and BROKEN.exists():
        raise RuntimeError("E2E_RULE_BROKEN: this rule fails on purpose from step 3")
    return rule_reward(prompt, response, answer)
'''

HOLDING_RULE = '''
import time
from pathlib import Path

from alignflow.data.synthetic import rule_reward

HOLD, HOLDING = Path({hold!r}), Path({holding!r})
calls = 0


def reward(prompt, response, answer):
    """From step 5 (4 steps of 8 prompts x 2 samples scored), waits while the hold file exists, saying so in the
    holding file: the round is then surely mid-step when the test cancels it, however fast the machine."""
    global calls
    calls += 1
    deadline = time.monotonic() + 900
    while calls > 64 and HOLD.exists() and time.monotonic() < deadline:
        HOLDING.touch()
        time.sleep(0.2)
    return rule_reward(prompt, response, answer)
'''

STATE_PROBE = """
import asyncio, json, sys
from uuid import UUID
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
async def main():
    async with get_client() as c:
        run = await c.read_flow_run(UUID(sys.argv[1]))
        tasks = await c.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [run.id]}))
        flows = await c.read_flow_runs()
        artifacts = await c.read_artifacts(flow_run_filter=FlowRunFilter(id={"any_": [run.id]}))
        of_deployment = await c.read_flow_runs(flow_run_filter=FlowRunFilter(
            deployment_id={"any_": [run.deployment_id]}))
        print(json.dumps({"state": run.state_name, "message": run.state.message, "run_count": run.run_count,
                          "flow_runs": [[str(f.id), f.state_name, str(f.parent_task_run_id or "")] for f in flows],
                          "deployment_runs": [str(f.id) for f in of_deployment],
                          "artifacts": {a.key: a.data for a in sorted(artifacts, key=lambda a: a.created) if a.key},
                          "tasks": [[t.name, t.state_name, (t.state.message if t.state else "") or "", sorted(t.tags), t.cache_key,
                                     t.empirical_policy.retry_delay]
                                    for t in sorted(tasks, key=lambda t: t.expected_start_time)]}))
asyncio.run(main())
"""


def _probe(env: dict[str, str], run_id: str) -> dict:
    return json.loads(_run([sys.executable, "-c", STATE_PROBE, run_id], env).stdout.strip().splitlines()[-1])


def _wait_final(env: dict[str, str], run_id: str, timeout: float = 1800) -> dict:
    """The probe, once the flow run is in a final state (or past `timeout`). Polled over the REST API, as the
    UI polls it: a probe is a Python process importing Prefect's client, about 3 s of CPU, and a probe every
    few seconds took a core's share from the run it waited on."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            res = httpx.get(f"{env['PREFECT_API_URL']}/flow_runs/{run_id}", timeout=30)
            res.raise_for_status()
        except httpx.HTTPError as err:  # a busy server's slow or 5xx answer: asked again (the probe says why)
            print(f"state poll: {type(err).__name__}: {err}")
        else:
            if res.json()["state_name"] in ("Completed", "Failed", "Crashed", "Cancelled"):
                break
        time.sleep(2)
    return _probe(env, run_id)


START_RUN = """
import json, sys
from prefect import get_client
from prefect.deployments import run_deployment
with get_client(sync_client=True) as c:
    nightly = c.read_deployment_by_name("alignflow-scheduled-pipeline/nightly")
    for s in nightly.schedules:
        c.update_deployment_schedule(nightly.id, s.id, active=False)
run = run_deployment("alignflow-scheduled-pipeline/pipeline", timeout=0,
                     parameters={"overrides": json.loads(sys.argv[1])})
print(run.id)
"""


def _start_pipeline_run(env: dict[str, str], overrides: list[str]) -> str:
    """A run of the pipeline deployment with `overrides`, its id. The nightly schedule is paused first: its runs
    share the pool, and the test's worker must run this one alone."""
    return _run([sys.executable, "-c", START_RUN, json.dumps(overrides)], env).stdout.strip().splitlines()[-1]


def _start_worker(env: dict[str, str], tmp_path: Path, extra_path: Path | None = None):
    """A `prefect worker` on the pool (its console in tmp_path/worker.log, open file returned with it)."""
    worker_env = {**env, "PYTHONPATH": os.pathsep.join(str(p) for p in (extra_path, env.get("PYTHONPATH")) if p),
                  "PYTHONDONTWRITEBYTECODE": "1"}
    log = open(tmp_path / "worker.log", "w")
    # SIGINT at its default: the worker stops on SIGTERM by sending itself SIGINT, which a shell without job
    # control (`cmd &`, some CI runners) would have left ignored in every process it starts.
    worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "alignflow-process"], env=worker_env, cwd=REPO,
                              stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return worker, log


def test_a_failed_deployment_run_retried_from_its_page_is_one_run_and_one_mlflow_parent(prefect_server,
                                                                                      small_pipeline_args, tmp_path,
                                                                                      process_tools):
    """The Retry button (the same API call the UI makes) reruns the failed flow run in place: finished stages
    come from cache, the round resumes from its checkpoint and says so, and MLflow keeps one parent."""
    url, env = prefect_server
    src = tmp_path / "rule_src"
    src.mkdir()
    marker = tmp_path / "rule-is-broken"
    marker.touch()
    (src / "e2e_flaky_rule.py").write_text(FLAKY_RULE.format(marker=str(marker)))
    round_cfg = {"algorithm": "grpo", "steps": 4, "checkpoint_every": 2, "prompts_per_step": 8,
                 "generation": {"num_samples": 2, "max_new_tokens": 8}, "ppo": {"epochs": 1, "minibatch_size": 16},
                 "reward": {"source": "rule", "rule": "e2e_flaky_rule:reward"}}
    overrides = [*small_pipeline_args(tmp_path, rounds=0), f"rounds={json.dumps([round_cfg])}", "infra.task_retries=0"]
    run_id = _start_pipeline_run(env, overrides)
    worker, log = _start_worker(env, tmp_path, extra_path=src)
    try:
        failed = _wait_final(env, run_id)
        worker_log = lambda: (tmp_path / "worker.log").read_text()[-8000:]  # noqa: E731
        assert failed["state"] == "Failed", f"{failed}\n{worker_log()}"
        assert "E2E_RULE_BROKEN" in worker_log()
        states = {t[0]: t[1] for t in failed["tasks"]}
        assert states["round_1"] == "Failed" and states["sft"] == "Completed", states

        # The failed run's process exits a few seconds after its Failed state; a Retry pressed before that
        # would have the worker report the exit as a crash of the rescheduled run.
        deadline = time.monotonic() + 300
        while "exited with status code" not in worker_log() and time.monotonic() < deadline:
            time.sleep(1)
        assert "exited with status code" in worker_log(), f"the failed run's process still runs\n{worker_log()}"
        marker.unlink()  # the fix; then Retry, as the flow run page's button does it
        retry = f"""
import asyncio
from uuid import UUID
from prefect.client.orchestration import get_client
from prefect.states import State, StateType
async def main():
    async with get_client() as c:
        state = State(type=StateType.SCHEDULED, name="AwaitingRetry", message="Retry from the UI")
        print((await c.set_flow_run_state(UUID("{run_id}"), state, force=False)).status)
asyncio.run(main())
"""
        assert "ACCEPT" in _run([sys.executable, "-c", retry], env).stdout
        done = _wait_final(env, run_id)
        assert done["state"] == "Completed", f"{done}\n{worker_log()}"
    finally:
        process_tools.stop_session(worker, timeout=60)
        log.close()

    # One flow run, no subflows: the stages are its own task runs.
    assert [r for r in done["flow_runs"] if r[0] == run_id] == [[run_id, "Completed", ""]], done["flow_runs"]
    assert not [r for r in done["flow_runs"] if r[2]], done["flow_runs"]  # no flow run inside a task run
    assert done["deployment_runs"] == [run_id], done  # the pipeline deployment ran once, retried in place
    assert done["run_count"] == 2, done
    latest: dict[str, list] = {}
    for name, state, message, tags, cache_key, retry_delay in done["tasks"]:
        if state != "Failed":
            latest[name] = [state, message, tags, cache_key, retry_delay]
    # Task details: the stage's key is the cache key, and the retry delay a number of seconds.
    for name, (state, _, _, cache_key, retry_delay) in latest.items():
        if state != "NotReady":
            assert re.fullmatch(rf"{name}-[0-9a-f]{{20}}", cache_key or ""), (name, cache_key)
            assert retry_delay == 2.0, (name, retry_delay)
    assert latest["round_1"][0] == "Completed" and latest["round_1"][1] == "resumed from step 2 of 4", done["tasks"]
    assert {"resumed", "resumed-from-step-2"} <= set(latest["round_1"][2]), latest
    for name in ("data", "base_model", "sft", "eval_base", "eval_sft"):
        assert latest[name][0] == "Cached", (name, latest)
    # Every task run is named by its stage; the one that never started (eval_round_1 of the first attempt)
    # keeps the suffix Prefect gives a run it names before the run starts.
    stages = {"data", "base_model", "sft", "round_1", "eval_base", "eval_sft", "eval_round_1"}
    assert {t[0] for t in done["tasks"] if t[1] != "NotReady"} == stages, done["tasks"]
    assert [re.sub(r"-\w{3}$", "", t[0]) for t in done["tasks"] if t[1] == "NotReady"] == ["eval_round_1"], \
        done["tasks"]
    # The plan, as the retry found it, is on the flow run: the round runs again, the rest is committed.
    plan = done["artifacts"]["plan"]
    assert re.search(r"round_1 .* will run: ", plan) and re.search(r"\n  sft .* Cached", plan), plan
    print("flow runs:", done["flow_runs"])
    print("task runs:", [t[:3] for t in done["tasks"]])
    print("cache keys:", {name: row[3] for name, row in latest.items()})
    # The worker's console: a line per stage's end, none of the libraries' chatter (as the CLI's quiet console).
    console = (tmp_path / "worker.log").read_text()
    assert "Task run 'sft' - Finished in state Completed()" in console and "E2E_RULE_BROKEN" in console
    for noise in ("set_num_threads", "Loading weights", "FutureWarning", "Token authentication"):
        assert noise not in console, f"{noise!r} on the worker's console"
    assert console.count("Traceback (most recent call last)") == 1, console[-6000:]  # the task run's, once
    print(f"worker console: {len(console.splitlines())} lines")

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("alignflow").experiment_id
    parents = client.search_runs([exp], filter_string=f"tags.`alignflow.prefect_flow_run_id` = '{run_id}'")
    assert len(parents) == 1, [(r.info.run_id, r.info.status) for r in parents]
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.tags["alignflow.attempt"] == "2"
    children = client.search_runs([exp], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    rounds = [r for r in children if r.data.tags["alignflow.stage"] == "round_1"]
    assert [(r.info.status, r.data.tags.get("alignflow.resumed_from_step")) for r in rounds] == [("FINISHED", "2")]
    steps = sorted(m.step for m in client.get_metric_history(rounds[0].info.run_id, "rl/reward/mean"))
    assert steps == [1, 2, 3, 4], steps  # the whole learning curve in one stage run
    assert {r.data.tags["alignflow.stage"] for r in children} >= {"data", "base_model", "sft", "round_1",
                                                                    "eval_base", "eval_sft", "eval_round_1"}


CANCEL = """
import asyncio, sys
from uuid import UUID
from prefect.client.orchestration import get_client
from prefect.states import Cancelling
async def main():
    async with get_client() as c:
        print((await c.set_flow_run_state(UUID(sys.argv[1]), Cancelling(), force=True)).status)
asyncio.run(main())
"""


def test_a_deployment_run_cancelled_mid_round_ends_cancelled_and_its_runs_killed(prefect_server, small_pipeline_args,
                                                                                  tmp_path, process_tools):
    """Cancel, as the flow run page's button does it (the Cancelling state), mid-round: the worker sends the flow
    run's process SIGTERM while it waits on Ray for the round. The run ends Cancelled (not Crashed), the round's
    task run Cancelled with none left Running, its MLflow parent and the round KILLED with no run left RUNNING,
    and nothing the run started outlives it."""
    url, env = prefect_server
    src, hold, holding = tmp_path / "rule_src", tmp_path / "hold", tmp_path / "holding"
    src.mkdir()
    hold.touch()
    (src / "e2e_holding_rule.py").write_text(HOLDING_RULE.format(hold=str(hold), holding=str(holding)))
    round_cfg = {"algorithm": "grpo", "steps": 12, "checkpoint_every": 4, "prompts_per_step": 8,
                 "generation": {"num_samples": 2, "max_new_tokens": 8}, "ppo": {"epochs": 1, "minibatch_size": 16},
                 "reward": {"source": "rule", "rule": "e2e_holding_rule:reward"}}
    overrides = [*small_pipeline_args(tmp_path, rounds=0), f"rounds={json.dumps([round_cfg])}", "infra.task_retries=0"]
    run_id = _start_pipeline_run(env, overrides)
    worker, log = _start_worker(env, tmp_path, extra_path=src)
    worker_log = lambda: (tmp_path / "worker.log").read_text()[-8000:]  # noqa: E731
    try:
        # The worker notices Cancelling on its next poll, seconds later: on a fast machine a round left running
        # would have finished by then (CI saw round_1 FINISHED), so the rule holds step 5 until the run is stopped.
        deadline = time.monotonic() + 1200
        while not holding.exists():
            assert time.monotonic() < deadline, f"round_1 not held at step 5 in 1200 s\n{worker_log()}"
            assert worker.poll() is None, worker_log()
            time.sleep(0.5)
        assert list((tmp_path / "artifacts").glob("round_1/*/checkpoints/step-*/manifest.json")), worker_log()
        started = {pid: t for pid, t in process_tools.tree(worker.pid).items() if pid != worker.pid}
        assert "ACCEPT" in _run([sys.executable, "-c", CANCEL, run_id], env).stdout
        final = _wait_final(env, run_id, timeout=300)
        assert final["state"] == "Cancelled", f"{final}\n{worker_log()}"
        tasks = {t[0]: (t[1], t[2]) for t in final["tasks"]}  # none left Running under the Cancelled run
        assert tasks["round_1"] == ("Cancelled", STOPPED) and tasks["sft"][0] == "Completed", tasks
        assert not [n for n, (state, _) in tasks.items() if state in ("Running", "Pending")], tasks
        deadline = time.monotonic() + 60
        while process_tools.alive(started) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = process_tools.alive(started)
        assert not left, [Path(f"/proc/{pid}/cmdline").read_bytes()[:120] for pid in left]
    finally:
        hold.unlink(missing_ok=True)
        process_tools.stop_session(worker, timeout=60)
        log.close()
    console = (tmp_path / "worker.log").read_text()
    assert "SystemError" not in console and "Failed to connect to GCS" not in console, console[-6000:]

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("alignflow").experiment_id
    [parent] = client.search_runs([exp], filter_string=f"tags.`alignflow.prefect_flow_run_id` = '{run_id}'")
    children = client.search_runs([exp], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    statuses = {r.data.tags["alignflow.stage"]: r.info.status for r in children}
    assert (parent.info.status, statuses.get("round_1"), statuses.get("sft")) == ("KILLED", "KILLED", "FINISHED"), \
        statuses
    assert "RUNNING" not in statuses.values(), statuses
    print(f"cancelled mid-round: {statuses}")
