"""The deployed flows' typed `config` parameter: the schema Prefect renders the Custom run form from,
the build step that fills it from a config file, and errors that name the parameter."""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools import validate

from alignflow.config import PipelineConfig, config_from_parameter, load_config
from alignflow.errors import ConfigError
from flows.deployed import config_parameter, run_pipeline, run_stage

REPO = Path(__file__).resolve().parents[2]


def _schema(flow) -> dict:
    return parameter_schema(flow).model_dump()


@pytest.mark.parametrize("flow", [run_pipeline, run_stage], ids=lambda f: f.name)
def test_the_config_parameter_is_the_pipeline_model_with_every_section(flow):
    schema = _schema(flow)
    assert schema["properties"]["config"]["$ref"] == "#/definitions/PipelineConfig"
    assert "config" in schema["required"] and "overrides" not in schema["required"]
    defs = schema["definitions"]
    top = defs["PipelineConfig"]
    assert list(top["properties"]) == list(PipelineConfig.model_fields)
    assert top["additionalProperties"] is False  # a typo in the form is refused, not ignored
    # A round's algorithm is a choice among the registry's names, with the default the form prefills.
    from alignflow.algorithms import ALGORITHMS

    algorithm = defs["RoundConfig"]["properties"]["algorithm"]
    assert set(algorithm["enum"]) == set(ALGORITHMS), algorithm
    # Bounds and descriptions reach the form (the server checks the bounds before a run is created).
    lr = defs["SFTConfig"]["properties"]["learning_rate"]
    assert lr.get("exclusiveMinimum") == 0 and lr.get("description"), lr
    assert defs["InfraConfig"]["properties"]["ray_address"]["description"]


def test_the_build_step_writes_what_the_file_sets_and_the_schema_accepts_it():
    out = config_parameter(str(REPO / "configs" / "dpo.yaml"))
    cfg = load_config(REPO / "configs" / "dpo.yaml")
    written = cfg.model_dump(mode="json", exclude_unset=True)
    assert {k: v for k, v in out["config"].items() if k in written} == {
        **written, "evaluation": {**written["evaluation"], "rm_margin_bins": [0.0, 0.5, 1.0, 2.0]}}
    assert out["config"]["preference"]["loss"] == "dpo" and "desirable_weight" not in out["config"]["preference"]
    assert PipelineConfig.model_validate(out["config"]) == cfg  # what the form shows is what runs
    schema = _schema(run_pipeline)
    assert validate({"config": out["config"], "overrides": []}, schema, raise_on_error=False) == []
    bad = {**out["config"], "sft": {**out["config"]["sft"], "learning_rate": -1.0}}
    errors = validate({"config": bad}, schema, raise_on_error=False)
    assert [list(e.path) for e in errors] == [["config", "sft"]] and "'learning_rate': -1.0" in errors[0].message


def test_a_broken_config_file_fails_the_build_step(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("sft: {learning_rat: 0.1}\n")
    with pytest.raises(ConfigError, match=r"sft\.learning_rat"):
        config_parameter(str(path))


def test_errors_name_the_deployment_parameter_a_value_came_from():
    tree = load_config().model_dump(mode="json")
    with pytest.raises(ConfigError) as err:
        config_from_parameter({**tree, "seed": "x"})
    assert "(from the deployment parameter `config`)" in str(err.value) and "seed" in str(err.value)
    with pytest.raises(ConfigError) as err:
        config_from_parameter(tree, ["sft.learning_rate=-1"])
    assert "sft.learning_rate" in str(err.value)
    assert "(from the deployment parameter `overrides`: sft.learning_rate=-1)" in str(err.value), err.value
    with pytest.raises(ConfigError, match=r"deployment parameter `config` must be a mapping.*got str"):
        config_from_parameter("configs/tiny.yaml")
    cfg, sources = config_from_parameter(tree, ["sft.max_steps=3"])
    assert cfg.sft.max_steps == 3 and sources.of("sft.max_steps").endswith("`overrides`: sft.max_steps=3")
    assert tree["sft"]["max_steps"] is None  # the parameter's own value is left as it was


def test_preflight_problems_name_the_parameter(tmp_path):
    from alignflow.preflight import preflight

    tree = load_config().model_dump(mode="json")
    cfg, sources = config_from_parameter(tree, [f"evaluation.checker=no_such_module_{tmp_path.name}:check"])
    found = preflight(cfg, sources=sources)
    [problem] = [p for p in found.problems if p.startswith("evaluation.checker")]
    assert "from the deployment parameter `overrides`: evaluation.checker=" in problem, problem


@pytest.mark.parametrize("entrypoint", ["flows/deployed.py:run_pipeline", "flows/deployed.py:run_stage"])
def test_a_deployed_flow_loaded_as_prefect_loads_it_unpickles_where_its_file_is_no_module(entrypoint, monkeypatch):
    """A worker's flow run loads the entrypoint as a module named `deployed`, and every Ray task it submits carries
    the flow (Prefect's serialized context): a Ray worker, which cannot import `deployed`, must unpickle it."""
    import subprocess
    import sys

    import ray.cloudpickle
    from prefect.flows import load_flow_from_entrypoint

    monkeypatch.chdir(REPO)  # the worker's flow run: in the checkout (prefect.yaml's pull step), the path relative
    flow = load_flow_from_entrypoint(entrypoint)
    assert flow.fn.__module__ in ("deployed", f"__prefect_loader_{flow.fn.__module__[17:-2]}__"), flow.fn.__module__
    data = ray.cloudpickle.dumps(flow)
    probe = "import pickle, sys; f = pickle.loads(sys.stdin.buffer.read()); print(f.name)"
    res = subprocess.run([sys.executable, "-c", probe], input=data, capture_output=True, cwd="/", timeout=120)
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    assert res.stdout.decode().strip() == flow.name


def test_the_build_step_shows_defaults_a_factory_makes():
    """The schema has no default for a field whose default a factory makes (the rounds, the reward model's
    margin bins): the form showed nightly.yaml's rounds empty, though its run has the two default rounds."""
    nightly = REPO / "deployments" / "configs" / "nightly.yaml"
    assert "rounds:" not in nightly.read_text()
    out = config_parameter(str(nightly))["config"]
    assert len(out["rounds"]) == len(PipelineConfig().rounds) == 2
    assert PipelineConfig.model_validate(out) == load_config(nightly)
    assert validate({"config": out, "overrides": []}, _schema(run_pipeline), raise_on_error=False) == []

