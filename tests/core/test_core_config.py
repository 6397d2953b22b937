"""Pipeline config: loading, overrides, validation errors, shipped configs, prefect.yaml."""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from alignflow.config import (
    ConfigError,
    PipelineConfig,
    TinyModelConfig,
    default_config_path,
    load_config,
    parse_override,
    resolve_paths,
)

REPO = Path(__file__).resolve().parents[2]
SHIPPED_CONFIGS = sorted(
    [*REPO.glob("configs/*.yaml"), *REPO.glob("deployments/configs/*.yaml"), *REPO.glob("alignflow/configs/*.yaml")]
)


def _write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- the embedded default ------------------------------------------------------


def test_default_config_is_the_embedded_tiny_yaml():
    assert default_config_path().is_file()
    raw = yaml.safe_load(default_config_path().read_text())
    cfg = load_config()
    assert isinstance(cfg, PipelineConfig)
    assert cfg.name == raw["name"] == "tiny"
    assert cfg.data.source == "synthetic"
    assert cfg.model.base == "tiny"
    assert cfg.sft.learning_rate == raw["sft"]["learning_rate"] == 2.0e-3
    assert cfg.sft.epochs == raw["sft"]["epochs"]
    assert cfg.reward_model.learning_rate == raw["reward_model"]["learning_rate"]
    assert cfg.data.synthetic.num_sft == raw["data"]["synthetic"]["num_sft"]
    assert cfg.evaluation.generation.max_new_tokens == raw["evaluation"]["generation"]["max_new_tokens"]
    assert cfg.infra.storage.root == "./artifacts"
    assert cfg.infra.mlflow_tracking_uri == "sqlite:///mlflow.db"


def test_repository_tiny_yaml_matches_the_embedded_default():
    # The deployments run configs/tiny.yaml; `alignflow run` runs the embedded
    # copy. They must describe the same pipeline.
    assert load_config(REPO / "configs" / "tiny.yaml") == load_config()


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.sft.learning_rate = 1.0  # type: ignore[misc]


# ---- overrides -------------------------------------------------------------------


def test_overrides_of_each_type():
    cfg = load_config(
        overrides=[
            "sft.batch_size=16",  # int
            "sft.learning_rate=0.0005",  # float
            "reward_model.learning_rate=1e-4",  # YAML 1.1 reads this as a string; pydantic coerces
            "infra.storage.root=s3://bucket/run1",  # nested string
            "infra.storage.endpoint_url=null",  # None
            "sft.max_steps=7",  # optional int
            "data.synthetic.sft_correct_fraction=0.5",  # three levels deep
        ]
    )
    assert cfg.sft.batch_size == 16 and isinstance(cfg.sft.batch_size, int)
    assert cfg.sft.learning_rate == 0.0005
    assert cfg.reward_model.learning_rate == pytest.approx(1e-4) and isinstance(cfg.reward_model.learning_rate, float)
    assert cfg.infra.storage.root == "s3://bucket/run1"
    assert cfg.infra.storage.endpoint_url is None
    assert cfg.sft.max_steps == 7
    assert cfg.data.synthetic.sft_correct_fraction == 0.5
    # Untouched siblings keep their YAML values.
    assert cfg.sft.epochs == 3
    assert cfg.infra.mlflow_tracking_uri == "sqlite:///mlflow.db"


@pytest.mark.parametrize(
    "text, parts, value",
    [
        ("a.b=3", ["a", "b"], 3),
        ("a.b=2.5", ["a", "b"], 2.5),
        ("a=true", ["a"], True),
        ("a.b.c=false", ["a", "b", "c"], False),
        ("a=[1, 2, x]", ["a"], [1, 2, "x"]),
        ("a={k: 1}", ["a"], {"k": 1}),
        ("a=", ["a"], None),
        ("a=s3://b/p?x=1", ["a"], "s3://b/p?x=1"),  # only the first '=' splits
        (" a.b =7", ["a", "b"], 7),
    ],
)
def test_parse_override_values(text, parts, value):
    got_parts, got_value = parse_override(text)
    assert got_parts == parts
    assert got_value == value
    assert type(got_value) is type(value)


def test_override_creates_a_missing_section():
    cfg = load_config(
        overrides=[
            "data.source=files",
            "data.sft.path=/data/sft.jsonl",
            "data.sft.messages_key=messages",
            "data.preference.path=/data/pref.parquet",
            "data.eval.path=/data/eval.json",
        ]
    )
    assert cfg.data.sft.path == "/data/sft.jsonl"
    assert cfg.data.sft.messages_key == "messages"
    assert cfg.data.preference.path == "/data/pref.parquet"
    assert cfg.data.prompts is None


def test_override_values_of_the_wrong_type():
    # A list is no value for a float field; the error names the field.
    with pytest.raises(ConfigError, match=r"sft\.learning_rate"):
        load_config(overrides=["sft.learning_rate=[1, 2]"])
    # Nor is a word or a fraction for an int field.
    with pytest.raises(ConfigError, match=r"sft\.batch_size"):
        load_config(overrides=["sft.batch_size=lots"])
    with pytest.raises(ConfigError, match=r"sft\.batch_size"):
        load_config(overrides=["sft.batch_size=2.5"])


def test_unknown_key_is_an_error_naming_the_dotted_field():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["sft.learnin_rate=0.1"])
    assert "sft.learnin_rate" in str(err.value)
    with pytest.raises(ConfigError, match=r"infra\.storage\.bucket"):
        load_config(overrides=["infra.storage.bucket=x"])
    with pytest.raises(ConfigError, match=r"\bbogus\b"):
        load_config(overrides=["bogus=1"])


def test_unknown_key_in_the_yaml_file_is_an_error(tmp_path):
    path = _write(tmp_path, "sft:\n  lerning_rate: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "sft.lerning_rate" in str(err.value)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    "override, field",
    [
        ("sft.learning_rate=-1", "sft.learning_rate"),
        ("sft.learning_rate=0", "sft.learning_rate"),
        ("sft.zero_stage=5", "sft.zero_stage"),
        ("reward_model.batch_size=0", "reward_model.batch_size"),
        ("data.synthetic.num_digits=1", "data.synthetic.num_digits"),
        ("data.synthetic.sft_correct_fraction=1.5", "data.synthetic.sft_correct_fraction"),
        ("evaluation.generation.top_p=0", "evaluation.generation.top_p"),
        ("evaluation.generation.backend=tgi", "evaluation.generation.backend"),
        ("model.dtype=float64", "model.dtype"),
        ("data.source=hub", "data.source"),
    ],
)
def test_bad_value_fails_naming_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    message = str(err.value)
    assert field in message
    assert "invalid pipeline config" in message


def test_every_bad_field_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["sft.learning_rate=-1", "reward_model.zero_stage=9"])
    assert "sft.learning_rate" in str(err.value)
    assert "reward_model.zero_stage" in str(err.value)


@pytest.mark.parametrize("text", ["foo", "sft.learning_rate", ""])
def test_malformed_override(text):
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(overrides=[text])


@pytest.mark.parametrize("text", ["sft..learning_rate=1", ".sft=1", "sft.=1", "=1"])
def test_override_with_an_empty_key_segment(text):
    with pytest.raises(ConfigError, match="empty key segment"):
        load_config(overrides=[text])


def test_override_into_a_scalar():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["name.sub=1"])
    assert "'name' is a value, not a section" in str(err.value)
    with pytest.raises(ConfigError, match="'learning_rate' is a value"):
        load_config(overrides=["sft.learning_rate.x=1"])


def test_override_a_list_item_by_index():
    cfg = load_config(overrides=["rounds.1.async_rollouts=true", "rounds.0.steps=7"])
    assert [r.async_rollouts for r in cfg.rounds] == [False, True]
    assert [r.steps for r in cfg.rounds][0] == 7
    with pytest.raises(ConfigError, match=r"'5' is not an item of a list of 2 \(items by index: 0..1\)"):
        load_config(overrides=["rounds.5.steps=3"])
    with pytest.raises(ConfigError, match="'x' is not an item of a list of 2"):
        load_config(overrides=["rounds.x=3"])


def test_a_staleness_bound_belongs_to_an_asynchronous_round():
    cfg = load_config(overrides=["rounds.1.async_rollouts=true", "rounds.1.max_staleness=2"])
    assert [(r.async_rollouts, r.max_staleness) for r in cfg.rounds] == [(False, 1), (True, 2)]
    for wrong in ("rounds.0.max_staleness=2", "rounds.0.partial_rollouts=true"):
        with pytest.raises(ConfigError, match=r"rounds\.0.*max_staleness and partial_rollouts shape asynchronous "
                                              "rollouts: set async_rollouts"):
            load_config(overrides=[wrong])
    with pytest.raises(ConfigError, match="max_staleness"):
        load_config(overrides=["rounds.1.async_rollouts=true", "rounds.1.max_staleness=0"])


# ---- credentials ---------------------------------------------------------------------

WRITTEN_OUT = {  # an override holding a credential -> (what the refusal names, where its client reads it instead)
    "infra.mlflow_tracking_uri=http://me:s3cr3t@127.0.0.1:1/":
        ("infra.mlflow_tracking_uri: http://127.0.0.1:1/ holds a password written out", "MLFLOW_TRACKING_PASSWORD"),
    "infra.mlflow_tracking_uri=postgresql://me:s3cr3t@db/mlflow":
        ("infra.mlflow_tracking_uri: postgresql://db/mlflow holds a password", "PGPASSWORD"),
    "infra.prefect_api_url=https://u:s3cr3t@prefect.example/api":
        ("infra.prefect_api_url: https://prefect.example/api holds a password", "PREFECT_API_AUTH_STRING"),
    "infra.storage.endpoint_url=http://127.0.0.1:9000/?X-Amz-Signature=s3cr3t":
        ("infra.storage.endpoint_url: http://127.0.0.1:9000/?X-Amz-Signature=*** holds query parameter "
         "'X-Amz-Signature'", "AWS_SECRET_ACCESS_KEY"),
    'rounds=[{"algorithm": "grpo", "reward": {"source": "remote", "url": "https://rm.example/s?api_key=s3cr3t"}}]':
        ("rounds.0.reward.url: https://rm.example/s?api_key=*** holds query parameter 'api_key'",
         "write ${NAME} in its place"),
    'rounds=[{"algorithm": "grpo", "environment": {"name": "m:Env", "kwargs": {"api_key": "s3cr3t"}}}]':
        ("rounds.0.environment.kwargs.api_key names a credential", "through the environment"),
}


@pytest.mark.parametrize("override", list(WRITTEN_OUT))
def test_a_credential_written_into_the_config_is_refused_saying_where_it_belongs(override):
    """A flow run keeps its config in Prefect's database and shows it in the UI, where no redaction reaches: a
    credential written out is refused when the config loads, before the flow starts, with the environment
    variable its client reads instead. The refusal quotes neither it nor the override that gave it."""
    where, instead = WRITTEN_OUT[override]
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    text = str(err.value)
    assert where in text and instead in text and "from the command line" in text
    assert "s3cr3t" not in text


def test_a_credential_is_refused_from_a_file_from_a_deployment_parameter_and_from_python(tmp_path):
    from alignflow.config.loading import config_from_parameter

    path = _write(tmp_path, "infra:\n  mlflow_tracking_uri: postgresql://me:s3cr3t@db/mlflow\n")
    with pytest.raises(ConfigError, match=rf"holds a password written out: .* \(from {re.escape(str(path))}\)"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"holds a password .*\(from the deployment parameter `config`\)") as err:
        config_from_parameter({"infra": {"mlflow_tracking_uri": "postgresql://me:s3cr3t@db/mlflow"}})
    with pytest.raises(ValidationError, match="holds a password written out") as made:
        PipelineConfig(infra={"mlflow_tracking_uri": "postgresql://me:s3cr3t@db/mlflow"})
    assert "s3cr3t" not in str(err.value) and "s3cr3t" not in str(made.value)


def test_what_is_not_a_credential_written_out_is_accepted():
    """A user name alone; a reward URL's `${NAME}`s (filled in where the service is called, test_rl_rewards);
    a token that is a setting. A `${NAME}` elsewhere is refused: nothing would fill it in."""
    cfg = load_config(None, [
        "infra.mlflow_tracking_uri=postgresql://me@db/mlflow",
        'rounds=[{"algorithm": "grpo", "reward": {"source": "remote", '
        '"url": "https://${RM_USER}:${RM_PASSWORD}@rm.example/s?api_key=${RM_API_KEY}"}}]'])
    assert cfg.rounds[0].reward.url == "https://${RM_USER}:${RM_PASSWORD}@rm.example/s?api_key=${RM_API_KEY}"
    load_config(None, ['rounds=[{"algorithm": "grpo", "environment": {"name": "m:Env", "kwargs": {"pad_token": "x", '
                       '"api_key_env": "OPENAI_API_KEY", "credentials_file": "/etc/x.json", "secret_name": "prod/rm"}}}]'])
    with pytest.raises(ConfigError, match=r"kwargs.openai_api_key names a credential"):
        load_config(None, ['rounds=[{"algorithm": "grpo", "environment": {"name": "m:Env", "kwargs": '
                           '{"openai_api_key": "sk-1"}}}]'])
    with pytest.raises(ConfigError, match="MLFLOW_TRACKING_PASSWORD"):
        load_config(None, ["infra.mlflow_tracking_uri=http://me:${PW}@127.0.0.1:1/"])


# ---- files -------------------------------------------------------------------------


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(path) in str(err.value)
    assert "does not exist" in str(err.value)


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "list"), ("just a string\n", "str"), ("42\n", "int")])
def test_yaml_that_is_not_a_mapping(tmp_path, text, kind):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "top level must be a mapping" in str(err.value)
    assert kind in str(err.value)
    assert str(path) in str(err.value)


def test_invalid_yaml_is_one_line_naming_the_file_line_and_column(tmp_path):
    """PyYAML's message ran over several lines and named the file '<unicode string>'."""
    path = _write(tmp_path, "sft:\n  epochs: 3\n   batch_size: 32\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: not valid YAML: line 3, column 14: mapping values are not allowed here"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["sft={epochs: 3"])
    assert str(err.value) == ("override 'sft={epochs: 3': the value is not valid YAML: line 1, column 11: expected "
                              "',' or '}', but got '<stream end>' (while parsing a flow mapping at line 1)")
    with pytest.raises(ConfigError, match=r"config file rounds.0.steps does not exist \(an override is key.sub=value: "
                                          r"rounds.0.steps=\.\.\.\?\)"):
        load_config("rounds.0.steps")


def test_a_section_given_twice_is_an_error_not_the_last_one(tmp_path):
    path = _write(tmp_path, "sft:\n  learning_rate: 0.5\n  batch_size: 8\nname: x\nsft:\n  epochs: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    text = str(err.value)
    assert text == (f"{path}: not valid YAML: line 5, column 1: found the key 'sft' twice (first at line 1); the "
                    "second would replace the first")


def test_a_config_that_is_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: not UTF-8 text"):
        load_config(path)


@pytest.mark.parametrize("round_, message", [
    ('{"algorithm": "rejection_sampling", "kl": {"coef": 0.5}}', "the rows of an update); leave out kl (kl.budget"),
    ('{"algorithm": "rejection_sampling", "ppo": {"epochs": 5, "dynamic_sampling": true}}', "leave out ppo ("),
    ('{"algorithm": "ppo", "rejection": {"threshold": 0.5}}', "the rejection section is rejection_sampling's"),
])
def test_settings_a_round_would_ignore_are_refused(round_, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides=[f"rounds=[{round_}]"])
    ok = load_config(overrides=['rounds=[{"algorithm": "rejection_sampling", "ppo": {"minibatch_size": 16}, '
                                '"kl": {"budget": 2.0}, "rejection": {"threshold": 1.0}}]'])
    assert ok.rounds[0].ppo.minibatch_size == 16 and ok.rounds[0].rejection.threshold == 1.0


def test_empty_file_gives_all_defaults(tmp_path):
    cfg = load_config(_write(tmp_path, "# nothing\n"))
    assert cfg == PipelineConfig()
    assert cfg.sft.learning_rate == 1e-3  # the class default, not tiny.yaml's


def test_file_then_overrides(tmp_path):
    path = _write(tmp_path, "name: mine\nsft: {learning_rate: 0.01, batch_size: 8}\n")
    cfg = load_config(path, ["sft.batch_size=4"])
    assert cfg.name == "mine"
    assert cfg.sft.learning_rate == 0.01
    assert cfg.sft.batch_size == 4


# ---- cross-field validation ---------------------------------------------------------


def test_files_source_needs_its_datasets():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["data.source=files"])
    message = str(err.value)
    assert "needs data.sft, data.eval" in message and "data.preference" not in message  # only where pairs are read


def test_data_files_under_the_synthetic_source_are_refused_not_ignored():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["data.sft.path=my.jsonl", "data.eval.path=e.jsonl"])
    assert ("data.sft, data.eval are given, but data.source is 'synthetic' (the bundled task): set data.source: "
            "files to read them") in str(err.value)
    with pytest.raises(ConfigError, match=r"data.prompts is given, but data.source is 'synthetic'"):
        load_config(overrides=["data.prompts.path=p.jsonl"])


def test_files_source_names_only_what_is_missing():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["data.source=files", "data.sft.path=a.jsonl", "data.eval.path=e.jsonl"])
    (message,) = str(err.value).splitlines()[1:]
    assert message.startswith("  data.preference: not given, but reward_model trains on preference pairs"), message
    assert "data.sft" not in message and "data.eval" not in message


@pytest.mark.parametrize(
    "kwargs, ok",
    [
        ({}, True),
        ({"hidden_size": 128, "num_heads": 8, "num_kv_heads": 8}, True),
        ({"hidden_size": 96, "num_heads": 6, "num_kv_heads": 3}, True),
        ({"hidden_size": 130, "num_heads": 4, "num_kv_heads": 2}, False),  # 130 % 4
        ({"hidden_size": 128, "num_heads": 4, "num_kv_heads": 3}, False),  # 4 % 3
        ({"hidden_size": 128, "num_heads": 2, "num_kv_heads": 4}, False),  # 2 % 4
    ],
)
def test_tiny_model_heads(kwargs, ok):
    if ok:
        cfg = TinyModelConfig(**kwargs)
        assert cfg.hidden_size % cfg.num_heads == 0
    else:
        with pytest.raises(ValidationError, match="num_heads"):
            TinyModelConfig(**kwargs)


def test_tiny_model_heads_through_load_config():
    with pytest.raises(ConfigError, match=r"model\.tiny"):
        load_config(overrides=["model.tiny.num_heads=3"])


# ---- resolve_paths -------------------------------------------------------------------


def test_resolve_paths_makes_local_paths_absolute(tmp_path):
    cfg = resolve_paths(load_config(), base=tmp_path)
    assert cfg.infra.storage.root == str(tmp_path.resolve() / "artifacts")
    assert cfg.infra.mlflow_tracking_uri == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    # Everything else is unchanged.
    assert cfg.sft == load_config().sft


def test_resolve_paths_defaults_to_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = resolve_paths(load_config())
    assert cfg.infra.storage.root == str(tmp_path.resolve() / "artifacts")


def test_resolve_paths_leaves_remote_and_absolute_uris_alone(tmp_path):
    cfg = load_config(
        overrides=[
            "infra.storage.root=s3://bucket/prefix",
            "infra.mlflow_tracking_uri=http://mlflow.internal:5000",
        ]
    )
    out = resolve_paths(cfg, base=tmp_path)
    assert out.infra.storage.root == "s3://bucket/prefix"
    assert out.infra.mlflow_tracking_uri == "http://mlflow.internal:5000"

    absolute = load_config(overrides=["infra.mlflow_tracking_uri=sqlite:////srv/mlflow.db"])
    assert resolve_paths(absolute, base=tmp_path).infra.mlflow_tracking_uri == "sqlite:////srv/mlflow.db"


def test_resolve_paths_expands_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = resolve_paths(load_config(overrides=["infra.storage.root=~/art"]), base=Path("/somewhere/else"))
    assert cfg.infra.storage.root == str(tmp_path.resolve() / "art")


# ---- every shipped config and prefect.yaml ------------------------------------------------


def test_shipped_configs_are_found():
    names = {p.relative_to(REPO).as_posix() for p in SHIPPED_CONFIGS}
    assert {"configs/tiny.yaml", "deployments/configs/nightly.yaml", "alignflow/configs/tiny.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    assert isinstance(cfg, PipelineConfig)
    raw = yaml.safe_load(path.read_text())
    assert cfg.name == raw.get("name", "tiny")


@functools.cache
def _deployments() -> list[dict]:
    """prefect.yaml's deployments with their parameters as `prefect deploy` makes them: each build step's
    function (found by its qualified name, as Prefect finds it) run in the repository, where deploy runs,
    and its output templated in by Prefect's own `apply_values`. Not through `run_steps`: that opens an
    API client for block and variable references (prefect.yaml has none), and at collection that started
    a temporary Prefect server in every pytest worker; two on a fresh PREFECT_HOME raced on its database
    and timed out. `prefect deploy` itself runs against a real server in tests/e2e/test_e2e_deploy.py."""
    from prefect.utilities.importtools import import_object
    from prefect.utilities.templating import apply_values

    text = (REPO / "prefect.yaml").read_text()
    assert "{{ prefect." not in text, "prefect.yaml references blocks or variables: build them through run_steps"
    spec = yaml.safe_load(text)
    outputs, cwd = {}, Path.cwd()
    os.chdir(REPO)
    try:
        for step in spec.get("build") or []:
            (fqn, inputs), = step.items()
            arguments = {k: v for k, v in inputs.items() if k not in ("id", "requires")}
            outputs[inputs["id"]] = import_object(fqn)(**arguments)
    finally:
        os.chdir(cwd)
    return [apply_values(d, outputs) for d in spec["deployments"]]


def test_prefect_yaml_parses():
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    assert isinstance(spec, dict)
    deployments = spec["deployments"]
    assert deployments, "prefect.yaml has no deployments"
    names = [d["name"] for d in deployments]
    assert len(names) == len(set(names)), f"duplicate deployment names: {names}"
    assert any(d.get("schedules") for d in deployments), "no scheduled deployment"
    for d in deployments:
        assert d.get("work_pool", {}).get("name"), f"{d['name']}: no work pool"


@pytest.mark.parametrize("deployment", _deployments(), ids=lambda d: d["name"])
def test_deployment_entrypoint_is_a_flow_accepting_its_parameters(deployment):
    from prefect import Flow

    file, func = deployment["entrypoint"].split(":")
    assert (REPO / file).is_file(), f"{deployment['name']}: {file} does not exist"
    module = importlib.import_module(file.removesuffix(".py").replace("/", "."))
    flow = getattr(module, func)
    assert isinstance(flow, Flow), f"{deployment['entrypoint']} is not a Prefect flow"
    params = deployment.get("parameters") or {}
    inspect.signature(flow.fn).bind(**params)  # raises TypeError on an unknown or missing parameter


@pytest.mark.parametrize("deployment", _deployments(), ids=lambda d: d["name"])
def test_deployment_parameters_name_a_valid_config_and_stage(deployment):
    from tasks.plan import plan_pipeline

    from alignflow.config import config_from_parameter

    params = deployment.get("parameters") or {}
    cfg, _ = config_from_parameter(params["config"], params.get("overrides"))
    if "stage" in params:
        assert plan_pipeline(cfg).resolve(params["stage"])


def test_every_stage_target_has_a_deployment():
    """The per-stage deployments come from the stage registry: one for each target, nothing else."""
    from tasks.registry import targets

    staged = [d["parameters"]["stage"] for d in _deployments() if "stage" in (d.get("parameters") or {})]
    assert sorted(staged) == sorted(targets())


def test_a_partial_round_section_keeps_the_round_defaults():
    """Setting one field of a round's actor/generation section must not reset
    the others to the generic TrainConfig/GenerationConfig defaults."""
    from alignflow.config import load_config

    default = load_config().rounds[0]
    cfg = load_config(None, ['rounds=[{"actor": {"num_workers": 1}, "generation": {"temperature": 0.7}}]']).rounds[0]
    assert cfg.actor.learning_rate == default.actor.learning_rate == 2e-4
    assert cfg.actor.warmup_steps == default.actor.warmup_steps == 0
    assert cfg.generation.max_new_tokens == default.generation.max_new_tokens == 8
    assert cfg.generation.temperature == 0.7


def test_sections_can_be_left_out_with_null():
    cfg = load_config(None, ["sft=null", "evaluation=null", "reward_model=null",
                             'rounds=[{"algorithm": "grpo", "reward": {"source": "rule"}}]'])
    assert cfg.sft is None and cfg.evaluation is None and cfg.reward_model is None
    # an override into a section set to null brings the section back, with its defaults
    back = load_config(None, ["sft=null", "sft.epochs=2"])
    assert back.sft.epochs == 2 and back.sft.batch_size == 32


def test_a_round_using_the_reward_model_needs_its_section():
    with pytest.raises(ConfigError, match=r"rounds\.0 \(ppo\).*reward_model is null"):
        load_config(None, ["reward_model=null"])
    # a PPO critic that starts from the policy, scoring with a rule: no reward model needed
    cfg = load_config(None, ["reward_model=null",
                             'rounds=[{"algorithm": "ppo", "critic": {"init": "policy"}, "reward": {"source": "rule"}}]'])
    assert not cfg.rounds[0].needs_reward_model


def test_unknown_algorithm_lists_the_registered_ones():
    from alignflow.algorithms import ALGORITHMS

    with pytest.raises(ConfigError) as err:
        load_config(None, ['rounds=[{"algorithm": "ppo2"}]'])
    assert "rounds.0.algorithm" in str(err.value)
    for name in ALGORITHMS:
        assert repr(name) in str(err.value)


def test_group_algorithms_need_a_group_from_their_spec():
    with pytest.raises(ConfigError, match="rloo needs generation.num_samples >= 2"):
        load_config(None, ['rounds=[{"algorithm": "rloo", "generation": {"num_samples": 1}}]'])
    assert load_config(None, ['rounds=[{"algorithm": "reinforce_pp", "generation": {"num_samples": 1}}]'])


def test_round_takes_the_algorithms_defaults_unless_set():
    from alignflow.algorithms import get_algorithm

    grpo = load_config(None, ['rounds=[{"algorithm": "grpo"}]']).rounds[0]
    assert grpo.kl.apply_as is None  # as written
    spec = get_algorithm("grpo")
    resolved = grpo.resolved()
    assert (resolved.kl.apply_as, resolved.kl.estimator, resolved.ppo.loss_agg) == (
        spec.kl_apply_as, spec.kl_estimator, spec.loss_agg) == ("loss", "k3", "token_mean")
    mine = load_config(None, ['rounds=[{"algorithm": "grpo", "kl": {"apply_as": "reward", "estimator": "k2"}}]'])
    assert (mine.rounds[0].resolved().kl.apply_as, mine.rounds[0].resolved().kl.estimator) == ("reward", "k2")


@pytest.mark.parametrize("field", ["data.synthetic.seed", "model.seed", "sft.seed", "evaluation.generation.seed"])
def test_seeds_live_in_one_place(field):
    with pytest.raises(ConfigError, match=rf"{field}: .*top-level `seed`"):
        load_config(None, [f"{field}=1"])
    assert load_config(None, ["seed=7"]).seed == 7


def test_overrides_are_named_as_the_source_of_errors():
    with pytest.raises(ConfigError, match=r"with overrides sft\.epochs=-1"):
        load_config(None, ["sft.epochs=-1"])


def test_each_invalid_field_names_where_its_value_was_set(tmp_path):
    """An error in an override says so (not the config file); one in the file names the file."""
    path = _write(tmp_path, "sft: {batch_size: 0}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["sft.epochs=-1", 'rounds=[{"algorithm": "ppo2"}]'])
    lines = str(err.value).splitlines()
    assert f"  sft.batch_size: Input should be greater than or equal to 1 (got 0) (from {path})" in lines
    assert "  sft.epochs: Input should be greater than 0 (got -1) (from the command line: sft.epochs=-1)" in lines
    (algo,) = [line for line in lines if line.startswith("  rounds.0.algorithm: ")]
    assert algo.endswith(""" (from the command line: rounds=[{"algorithm": "ppo2"}])""")


def test_override_fields_maps_each_dotted_key_to_the_override_that_set_it_last():
    from alignflow.config.loading import override_fields

    assert override_fields(["a.b=1", " c =2", "a.b=3", "rounds=[{x: 1}]"]) == {
        "c": " c =2", "a.b": "a.b=3", "rounds": "rounds=[{x: 1}]"}


@pytest.mark.parametrize("override,field", [
    ('preference={"loss": "cdpo"}', "label_smoothing > 0"),
    ('preference={"loss": "kto", "label_smoothing": 0.1}', "preference.label_smoothing is read by cdpo and robust"),
    ('preference={"loss": "robust"}', "preference.loss=robust needs preference.label_smoothing > 0"),
    ('preference={"loss": "hinge", "label_smoothing": 0.1}', "with preference.loss=hinge set it to 0"),
    ('preference={"loss": "simpo", "rpo_alpha": 1.0}', "preference.rpo_alpha adds an NLL term to DPO's family"),
    ('sft={"packing_max_tokens": 256}', "packing_max_tokens is packing's row width"),
    ('data={"source": "files", "sft": {"path": "s.jsonl", "label_key": "ok"}, "preference": {"path": "p.jsonl"}, '
     '"eval": {"path": "e.jsonl"}}', "data.sft cannot use it"),
    ('preference={"loss": "dpo", "label_smoothing": 0.1}', "preference.label_smoothing is read by cdpo and robust"),
    ('preference={"loss": "ipo", "undesirable_weight": 2.0}', "preference.undesirable_weight is kto's"),
    ('preference={"loss": "orpo", "simpo_gamma": 1.0}', "preference.simpo_gamma is simpo's; preference.loss is orpo"),
    ('preference={"loss": "rrhf"}', "preference.loss"),
])
def test_preference_options_belong_to_their_loss(override, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        load_config(None, [override])


def test_every_loss_of_dpos_family_is_a_name_the_pure_loss_knows_and_rpo_leaves_earlier_keys_alone():
    import algos
    from alignflow.config import RoundConfig, cache_relevant
    from alignflow.config.preference import DPO_LOSS_TYPE, SMOOTHED

    assert set(DPO_LOSS_TYPE.values()) <= set(algos.DPO_LOSS_TYPES) and set(SMOOTHED) <= set(DPO_LOSS_TYPE)
    assert {DPO_LOSS_TYPE[n] for n in SMOOTHED} <= set(algos.SMOOTHED_LOSS_TYPES)
    for name in DPO_LOSS_TYPE:
        smoothing = ', "label_smoothing": 0.1' if name in SMOOTHED else ""
        pref = load_config(None, [f'preference={{"loss": "{name}", "rpo_alpha": 0.5{smoothing}}}']).preference
        assert (pref.loss, pref.rpo_alpha) == (name, 0.5)
    online = RoundConfig(algorithm="online_dpo", dpo={"loss": "apo_down", "rpo_alpha": 1.0}).dpo
    assert (online.loss, online.rpo_alpha) == ("apo_down", 1.0)
    assert "rpo_alpha" not in cache_relevant(RoundConfig(algorithm="online_dpo"))["dpo"]  # at its default


def test_preference_is_off_by_default_and_takes_its_own_defaults():
    assert load_config(None, []).preference is None
    pref = load_config(None, ['preference={"loss": "kto", "desirable_weight": 1.33}']).preference
    assert (pref.loss, pref.beta, pref.desirable_weight, pref.learning_rate) == ("kto", 0.1, 1.33, 5e-4)
    simpo = load_config(None, ['preference={"loss": "simpo", "beta": 2.0, "simpo_gamma": 1.0}']).preference
    assert (simpo.loss, simpo.beta, simpo.simpo_gamma) == ("simpo", 2.0, 1.0)


@pytest.mark.parametrize("round_,message", [
    ({"algorithm": "online_dpo", "kl": {"coef": 0.1}}, "online_dpo takes DPO steps"),
    ({"algorithm": "online_dpo", "ppo": {"epochs": 3}}, "leave out ppo"),
    ({"algorithm": "grpo", "dpo": {"beta": 0.2}}, "the dpo section is online_dpo's"),
    ({"algorithm": "online_dpo", "dpo": {"loss": "cdpo"}}, "dpo.loss=cdpo needs dpo.label_smoothing > 0"),
    ({"algorithm": "online_dpo", "dpo": {"loss": "nca", "label_smoothing": 0.2}}, "with dpo.loss=nca set it to 0"),
    ({"algorithm": "online_dpo", "prompts_per_step": 32, "dpo": {"pairs_per_update": 5},
      "actor": {"num_workers": 2}}, "must be a multiple of it, got 5"),
    ({"algorithm": "grpo", "actor": {"freeze_steps": 2}}, "actor.freeze_steps trains the critic alone; grpo "
     "has no critic"),
    ({"algorithm": "ppo", "steps": 4, "actor": {"freeze_steps": 4}}, "actor.freeze_steps (4) must be < steps (4)"),
])
def test_a_round_refuses_sections_its_update_ignores(round_, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [f"rounds={json.dumps([round_])}"])


def test_an_online_dpo_round_plans_with_its_resolved_config():
    from tasks.plan import plan_pipeline

    cfg = load_config(None, ['rounds=[{"algorithm": "online_dpo", "dpo": {"beta": 0.2}}]'])
    stage = plan_pipeline(cfg).stages["round_1"]
    assert stage.config.round.dpo.beta == 0.2 and stage.inputs["reference"] == "sft"


def test_a_dumped_config_loads_back_and_online_dpo_keeps_its_kl_budget(tmp_path):
    """`alignflow validate` prints every section, defaults included: what it prints must load again."""
    rounds = [{"algorithm": "online_dpo", "kl": {"budget": 1.5}}, {"algorithm": "grpo"}]
    cfg = load_config(None, [f"rounds={json.dumps(rounds)}"])
    assert cfg.rounds[0].kl.budget == 1.5
    path = tmp_path / "dumped.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert load_config(path, []) == cfg


@pytest.mark.parametrize("lifetime, num_gpus, keeps", [
    ("auto", 0, True), ("auto", 1, False), ("stage", 0, False), ("run", 0, True), ("run", 1, True)])
def test_evaluation_engine_lifetime_resolves(lifetime, num_gpus, keeps):
    cfg = load_config(overrides=[f"evaluation.engine_lifetime={lifetime}",
                                 f"evaluation.generation.placement.num_gpus={num_gpus}"])
    assert cfg.evaluation.keeps_engine is keeps


def test_a_tensor_parallel_evaluation_engine_cannot_live_for_the_run():
    with pytest.raises(ConfigError, match="evaluation: .*engine_lifetime: run .*tensor_parallel_size"):
        load_config(overrides=["evaluation.engine_lifetime=run", "evaluation.generation.placement.num_gpus=1",
                               "evaluation.generation.vllm.tensor_parallel_size=2"])
    auto = load_config(overrides=["evaluation.generation.placement.num_gpus=1",
                                  "evaluation.generation.vllm.tensor_parallel_size=2"])
    assert auto.evaluation.keeps_engine is False


# ---- GPU placements that would fail on the GPU, refused up front ------------------------------------------


@pytest.mark.parametrize(
    "overrides, field, says",
    [
        (["model.attn_implementation=flash_attention_2", "model.dtype=float32"], "model",
         "flash_attention_2 runs in bfloat16 or float16 only"),
        (["sft.placement.num_gpus=2"], "sft.placement.num_gpus", "an actor uses one GPU"),
        (["rounds.0.generation.placement.num_gpus=1.5"], "rounds.0.generation.placement.num_gpus",
         "an actor uses one GPU"),
        (["sft.placement.num_gpus=0.5", "sft.num_workers=2"], "sft", "NCCL refuses such a group"),
        # flash-attn's kernels run on CUDA tensors only: a model the evaluation scores on the CPU would fail
        # there, after every stage before it
        (["model.attn_implementation=flash_attention_2", "model.dtype=bfloat16", "evaluation.scorer_placement.num_gpus=0"],
         "(num_gpus: 0): evaluation.scorer_placement;", "flash_attention_2 runs on GPUs only"),
        (["model.attn_implementation=flash_attention_2", "model.dtype=bfloat16", "rounds.1.generation.backend=hf",
          "rounds.1.colocate_all=false", "rounds.1.generation.placement.num_gpus=0"], "rounds.1.generation.placement;",
         "runs on GPUs only"),
    ],
)
def test_gpu_placements_nccl_or_the_kernels_would_refuse(overrides, field, says):
    gpu_small = REPO / "configs" / "gpu-small.yaml"
    load_config(gpu_small)  # as shipped: valid
    with pytest.raises(ConfigError, match=re.escape(says)) as err:
        load_config(gpu_small, overrides)
    assert field in str(err.value)
    # the neighbours of each refused value stay valid
    load_config(gpu_small, ["model.attn_implementation=flash_attention_2", "model.dtype=bfloat16",
                            "sft.placement.num_gpus=0.5", "sft.num_workers=1", "reward_model.num_workers=2"])
    # vLLM engines run their own attention: on the CPU beside flash-attn models they are no problem (not
    # colocated: colocate_all gives every engine a share of the actor's GPUs)
    load_config(gpu_small, ["model.attn_implementation=flash_attention_2", "model.dtype=bfloat16",
                            "rounds.1.colocate_all=false", "rounds.1.generation.placement.num_gpus=0"])


def test_colocated_vllm_on_gpus_needs_its_memory_share_set(tmp_path):
    """vLLM checks at start that gpu_memory_utilization of the whole GPU is free; colocated, the trainers and
    scorers hold theirs already, so the 0.9 default would fail the first round after SFT and the reward model."""
    text = (REPO / "configs" / "gpu-small.yaml").read_text()
    assert "vllm: {gpu_memory_utilization: 0.3, enable_prefix_caching: true}" in text
    unset = _write(tmp_path, text.replace("vllm: {gpu_memory_utilization: 0.3, enable_prefix_caching: true}",
                                          "vllm: {enable_prefix_caching: true}"))
    with pytest.raises(ConfigError, match=r"rounds\.0.*generation\.vllm\.gpu_memory_utilization .*0\.9 by default"):
        load_config(unset)
    assert load_config(unset, ["rounds.0.generation.vllm.gpu_memory_utilization=0.9",
                               "rounds.1.generation.vllm.gpu_memory_utilization=0.25"]).rounds[1].generation.vllm \
        .gpu_memory_utilization == 0.25  # set, even to the default: the user's choice
    # without GPUs (a CPU run of the same config) there is no memory to share, and the HF backend takes no share
    load_config(unset, [f"rounds.{i}.{p}.num_gpus=0" for i in (0, 1) for p in
                        ("actor.placement", "generation.placement", "critic.placement", "scorer_placement")])
    load_config(unset, ["rounds.0.generation.backend=hf", "rounds.1.generation.backend=hf"])


def test_an_override_of_one_use_of_a_yaml_alias_sets_that_use_only(tmp_path):
    """configs/gpu-small.yaml writes its second round as `- *round`: an override of rounds.1 is of round 2."""
    cfg = load_config(REPO / "configs" / "gpu-small.yaml", ["rounds.1.steps=7"])
    assert [r.steps for r in cfg.rounds] == [load_config(REPO / "configs" / "gpu-small.yaml").rounds[0].steps, 7]


def test_colocated_placements_that_colocation_would_override_are_refused():
    """colocate_all gives every model and engine it starts a share of the actor's GPUs (engines/rl/round_placement.py
    gpu_share): another num_gpus in a placement it uses would not hold, and is refused; 0, the default, is the
    share's to set, and a resolved config dumped whole (every field set) loads again."""
    from alignflow.config.loading import validate_config

    gpu_small = REPO / "configs" / "gpu-small.yaml"
    for place in ("generation.placement", "critic.placement", "scorer_placement"):
        with pytest.raises(ConfigError, match=re.escape(f"{place}.num_gpus: 0.5 would not hold; set 1.0")):
            load_config(gpu_small, [f"rounds.0.{place}.num_gpus=0.5"])
        load_config(gpu_small, [f"rounds.0.{place}.num_gpus=0"])
    # the actor on the CPU, the engine asked onto a GPU: it would run on the CPU
    with pytest.raises(ConfigError, match=re.escape("generation.placement.num_gpus: 1.0 would not hold; set 0")):
        load_config(None, ['rounds=[{"colocate_all": true, "generation": {"placement": {"num_gpus": 1}}}]'])
    # a placement the round does not use is not its business (GRPO has no critic)
    load_config(gpu_small, ["rounds.0.algorithm=grpo", "rounds.0.critic.placement.num_gpus=0.5"])
    validate_config(load_config(gpu_small).model_dump(mode="json"))


# ---- mixed reward sources ---------------------------------------------------------------------------

RULE = {"source": "rule", "rule": "alignflow.rewards:math_equal"}


def test_a_mix_of_reward_sources_and_its_one_source_short_form():
    mix = [RULE, {"source": "model", "weight": 0.5}, {**RULE, "name": "format", "weight": -1.0}]
    r = load_config(None, [f'rounds=[{{"reward": {{"sources": {json.dumps(mix)}}}}}]']).rounds[0].reward
    assert [(c.label, c.weight) for c in r.components] == [("rule", 1.0), ("model", 0.5), ("format", -1.0)]
    assert r.uses_model and [f for f, _ in r.source_fields("rounds.0.reward")] == [
        "rounds.0.reward.sources.0", "rounds.0.reward.sources.1", "rounds.0.reward.sources.2"]
    short = load_config(None, ['rounds=[{"reward": {"source": "rule"}}]']).rounds[0].reward
    assert [(c.source, c.weight, c.rule) for c in short.components] == [("rule", 1.0, short.rule)]
    assert not short.uses_model and [f for f, _ in short.source_fields("rounds.0.reward")] == ["rounds.0.reward"]


@pytest.mark.parametrize("reward, message", [
    ({"source": "rule", "sources": [RULE]}, "leave out reward.source (the one-source form)"),
    ({"sources": [RULE, RULE]}, "two components are named 'rule'; give each a `name`"),
    ({"sources": [{**RULE, "name": "mean"}]}, "name 'mean' is a reward metric of its own"),
    ({"sources": [{**RULE, "name": "acc@1"}]}, "name 'acc@1' would make the metric reward/acc@1, which MLflow "
                                               "refuses"),
    ({"sources": [{**RULE, "name": ".."}]}, "name '..' would make the metric"),
    ({"sources": [{**RULE, "name": "format/"}]}, "name 'format/' would make"),
    ({"sources": [{**RULE, "name": "r" * 241}]}, "at most 240 characters"),
    ({"sources": [{"source": "model"}, {"source": "model", "name": "again"}]}, "one reward model per round"),
    ({"sources": []}, "reward.sources is empty"),
    ({"sources": [{"source": "remote"}]}, "source 'remote' needs url"),
])
def test_a_wrong_mix_is_named(reward, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [f'rounds=[{{"reward": {json.dumps(reward)}}}]'])


@pytest.mark.parametrize("reward, message", [
    ({"rule": "my.mod:score"}, "rule is source rule's setting, and this source is model: set source: rule"),
    ({"source": "rule", "url": "http://x", "timeout_s": 3},
     "url and timeout_s are source remote's settings, and this source is rule"),
    ({"sources": [{"source": "judge", "rule": "my.mod:score"}]}, "rule is source rule's setting, and this source is "
                                                                 "judge"),
])
def test_a_setting_of_another_source_is_refused_not_ignored(reward, message):
    """`rule` beside the default source (model) scored with the reward model while the user meant the rule."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f'rounds=[{{"algorithm": "grpo", "reward": {json.dumps(reward)}}}]'])


def test_a_config_object_given_to_the_pipeline_keeps_what_its_author_set():
    """A PipelineConfig passed to the pipeline flow from Python is validated again as the fields its author set,
    as a mix of reward sources beside the one-source form's defaults (a dumped config loads too)."""
    from flows.pipeline import deployment_config

    mix = [RULE, {"source": "model", "weight": 0.5}]
    cfg = load_config(None, [f'rounds=[{{"algorithm": "grpo", "reward": {{"sources": {json.dumps(mix)}}}}}]'])
    again, _ = deployment_config(cfg)
    assert again.rounds == cfg.rounds


@pytest.mark.parametrize("override, message", [
    ('rounds=[{"algorithm": "grpo", "generation": {"temperature": 0}}]',
     r"rounds.0.generation.*temperature 0 samples greedily: a prompt's 4 samples \(num_samples\) would be one "
     r"response 4 times; set num_samples: 1"),
    ('rounds=[{"algorithm": "grpo", "generation": {"temperature": 0, "num_samples": 1}}]',
     "grpo needs generation.num_samples >= 2"),
    ('rounds=[{"algorithm": "ppo", "generation": {"temperature": 0}}]', "would be one response 4 times"),
    ("evaluation.generation.temperature=0", r"evaluation.generation.*a prompt's 4 samples"),
    ('rounds=[{"actor": {"num_workers": 3}}]', r"ppo.minibatch_size \(64\), an update's rows, is split evenly "
                                               r"across actor.num_workers \(3\)"),
    ('rounds=[{"critic": {"num_workers": 3}}]', r"across critic.num_workers \(3\)"),
    ("sft.num_workers=3", r"  sft: batch_size \(32\) is split evenly across num_workers \(3\)"),
])
def test_a_round_that_could_not_learn_or_split_its_rows_is_refused_up_front(override, message):
    """Several greedy samples of a prompt are one response (vLLM and transformers refuse them, at the first batch
    of a round or evaluation), and an update's rows split across ranks that do not divide them raised only when
    the round started, after SFT."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
    assert load_config(None, ['rounds=[{"algorithm": "ppo", "generation": {"temperature": 0, "num_samples": 1}}]'])


def test_a_mix_with_the_reward_model_needs_its_section():
    def rounds(mix):
        return f'rounds=[{{"algorithm": "grpo", "reward": {{"sources": {json.dumps(mix)}}}}}]'

    with pytest.raises(ConfigError, match=r"rounds.0 \(grpo\) use the reward model"):
        load_config(None, ["reward_model=null", rounds([RULE, {"source": "model"}])])
    assert not load_config(None, ["reward_model=null", rounds([RULE])]).rounds[0].needs_reward_model


def test_the_longest_response_is_an_episodes_where_a_round_has_an_environment():
    """DAPO's overlong shaping and Dr. GRPO's constant measure a row's sampled tokens against this: one
    response's max_new_tokens, or an episode's turns (capped by its token budget)."""
    def round_(r):
        return load_config(None, [f"rounds=[{json.dumps(r)}]"]).rounds[0]

    env = {"name": "boxes", "max_turns": 3}
    assert round_({"generation": {"max_new_tokens": 8}}).max_response_tokens == 8
    assert round_({"generation": {"max_new_tokens": 8}, "environment": env}).max_response_tokens == 3 * 8
    per_turn = {**env, "max_tokens_per_turn": 5}
    assert round_({"environment": per_turn}).max_response_tokens == 3 * 5
    assert round_({"environment": {**per_turn, "max_episode_tokens": 12}}).max_response_tokens == 12
    agent = {"agent": "a:b", "max_tokens_per_turn": 5}  # the endpoint keeps an agent to the same limits
    assert round_({"environment": {**agent, "max_episode_tokens": 40}}).max_response_tokens == 4 * 5
    assert round_({"environment": {**agent, "max_episode_tokens": 12}}).max_response_tokens == 12
    # A buffer longer than one turn fits an episode of three; the same buffer on single responses is refused
    # when the config loads, naming the field, not at the round's first step.
    assert round_({"reward": {"overlong_buffer": 20}, "environment": env}).reward.overlong_buffer == 20
    with pytest.raises(ConfigError, match=r"reward.overlong_buffer \(20\) must be <= the longest response, "
                                          r"generation.max_new_tokens = 8"):
        round_({"reward": {"overlong_buffer": 20}})
    with pytest.raises(ConfigError, match=r"environment.max_episode_tokens\) = 12"):
        round_({"reward": {"overlong_buffer": 13}, "environment": {**per_turn, "max_episode_tokens": 12}})


def test_on_policy_distillation_refuses_nucleus_sampling():
    """A distillation round takes the engines' log-probs as the student's; with top_p < 1 they are of the
    renormalised nucleus, against the teacher's of the whole distribution: each token's pull shifted."""
    with pytest.raises(ConfigError, match=r"generation.top_p=0.9 the engines' are of the renormalised nucleus"):
        load_config(None, ['rounds=[{"algorithm": "distill", "teacher": "base", "reward": {"source": "rule"}, '
                           '"generation": {"top_p": 0.9}}]'])
    load_config(None, ['rounds=[{"algorithm": "grpo", "generation": {"top_p": 0.9}}]'])  # TIS's to weigh


@pytest.mark.parametrize("ppo", ['{"dynamic_sampling": true}', '{"dynamic_sampling_mean_range": [0.1, 0.9]}'])
def test_on_policy_distillation_refuses_dynamic_sampling_on_a_reward_it_does_not_train_on(ppo):
    with pytest.raises(ConfigError, match=r"ppo.dynamic_sampling would drop the groups whose \(unused\) rewards"):
        load_config(None, ['rounds=[{"algorithm": "distill", "teacher": "base", "reward": {"source": "rule"}, '
                           f'"ppo": {ppo}}}]'])
    load_config(None, [f'rounds=[{{"algorithm": "grpo", "ppo": {ppo}}}]'])  # a reward-trained round reads it


def test_a_teachers_or_judges_revision_pins_a_hub_model_and_nothing_else():
    distill = '{"algorithm": "distill", "reward": {"source": "rule"}, '
    with pytest.raises(ConfigError, match="teacher_revision pins the teacher's hub model: give the teacher"):
        load_config(None, ['rounds=[{"algorithm": "grpo", "teacher_revision": "v1"}]'])
    with pytest.raises(ConfigError, match=r"rounds.0.teacher_revision: 'sft' is a policy of this pipeline"):
        load_config(None, [f'rounds=[{distill}"teacher": "sft", "teacher_revision": "v1", "start_from": "base"}}]'])
    with pytest.raises(ConfigError, match=r"distill.teacher_revision: 'round_1' is a policy of this pipeline"):
        load_config(None, ['rounds=[{"algorithm": "grpo"}]', 'distill={"teacher": "round_1", "teacher_revision": "v"}'])
    with pytest.raises(ConfigError, match="revision pins a judge model named by hub id"):
        load_config(None, ['judge={}', 'rounds=[{"algorithm": "grpo", "reward": {"source": "judge", '
                                       '"judge": {"revision": "v1"}}}]'])
    cfg = load_config(None, [f'rounds=[{distill}"teacher": "org/t", "teacher_revision": "v1"}}]',
                             'distill={"teacher": "org/t", "teacher_revision": "v2"}'])
    assert (cfg.rounds[0].teacher_revision, cfg.distill.teacher_revision) == ("v1", "v2")


def test_a_lora_round_from_its_reference_needs_no_reference_scorer_placed():
    """With LoRA, a round that starts from its KL reference takes the reference from its own actor, adapters
    off (engines/rl/round_placement.py): no scorer starts, so flash-attn's GPU check leaves its placement
    alone. Later rounds, and rounds without LoRA, keep a reference scorer and its check."""
    grpo = {"algorithm": "grpo", "reward": {"source": "rule"}, "kl": {"coef": 0.05}}
    lora = {**grpo, "actor": {"lora": {"rank": 4}}}
    cfg = load_config(overrides=[f"rounds={json.dumps([lora, lora])}"])
    assert cfg.rounds[0].uses_reference and cfg.reference_is_actor(0) and not cfg.reference_is_actor(1)
    assert "rounds.0.scorer_placement" not in cfg.hf_placements()
    assert "rounds.1.scorer_placement" in cfg.hf_placements()
    from_sft = load_config(overrides=[f"rounds={json.dumps([grpo, {**lora, 'start_from': 'sft'}])}"])
    assert from_sft.reference_is_actor(1) and not from_sft.reference_is_actor(0)
    assert not load_config(overrides=[f"rounds={json.dumps([grpo])}"]).reference_is_actor(0)
    with_model = {**lora, "reward": {"source": "model"}}  # the reward model still needs the scorer
    assert "rounds.0.scorer_placement" in load_config(overrides=[f"rounds={json.dumps([with_model])}"]).hf_placements()


def test_text_fields_keep_their_override_as_written():
    """YAML would read an all-digit commit as a number (octal where it starts with 0), `a: b` as a mapping and
    ` #...` as a comment: a field that takes text keeps the text; others still take YAML."""
    cfg = load_config(None, ["model.base=org/model", "model.revision=0123456", "name=2024",
                             'rounds=[{"algorithm": "grpo", "reward": {"source": "judge", "judge": {"model": "j"}}}]',
                             "rounds.0.reward.judge.pattern=verdict: (yes|no)", "data.source=synthetic",
                             "infra.mlflow_experiment=exp #1", "rounds.0.steps=7", "sft.gradient_checkpointing=yes"])
    assert (cfg.model.revision, cfg.name, cfg.infra.mlflow_experiment) == ("0123456", "2024", "exp #1")
    assert load_config(None, ['name="a #b"']).name == "a #b"  # the user's own quotes stand
    assert cfg.rounds[0].reward.judge.pattern == "verdict: (yes|no)"
    assert cfg.rounds[0].steps == 7 and cfg.sft.gradient_checkpointing is True
    assert load_config(None, ["model.base=org/m", "model.revision=null"]).model.revision is None
    assert load_config(None, ["model.base=org/m", 'model.revision="v1"']).model.revision == "v1"


def test_an_override_into_a_level_the_file_leaves_out_starts_from_its_default(tmp_path):
    """A file without `rounds:` runs the default rounds: `rounds.1.steps=5` sets the default second round's steps
    (it was a dict where a list belongs). A dict with a default (a judge's verdict scores) gets the key added,
    not the whole dict replaced by it (the default `no` silently gone)."""
    from alignflow.config import PipelineConfig

    nightly = Path(__file__).resolve().parents[2] / "deployments" / "configs" / "nightly.yaml"
    default = PipelineConfig().rounds
    cfg = load_config(nightly, ["rounds.1.steps=5"])
    assert len(cfg.rounds) == len(default) == 2 and cfg.rounds[1].steps == 5
    assert cfg.rounds[0] == load_config(nightly).rounds[0] and cfg.rounds[1].actor == default[1].actor
    judge = ['rounds=[{"algorithm": "grpo", "reward": {"source": "judge", "judge": {"model": "j"}}}]',
             "rounds.0.reward.judge.scores.yes=2"]
    assert load_config(None, judge).rounds[0].reward.judge.scores == {"yes": 2.0, "no": 0.0}
    with pytest.raises(ConfigError, match=r"'0' is not an item of a list of 0 \(it is empty\)"):
        load_config(None, ["rounds=[]", "rounds.0.steps=1"])


def test_yaml_merge_keys_and_yaml_1_2_booleans_in_a_config_file(tmp_path):
    """`<<: *round` is how a file says "round 2 is round 1 and ..." (it failed: no constructor for the merge tag);
    `{yes: 1.0, no: 0.0}`, the README's verdict scores, were the booleans True and False (YAML 1.1)."""
    path = tmp_path / "c.yaml"
    path.write_text("rounds:\n  - &r {algorithm: grpo, steps: 5, reward: {source: judge, judge: {model: j, "
                    "scores: {yes: 1.0, no: 0.0}}}}\n  - <<: *r\n    steps: 9\n"
                    "sft: {gradient_checkpointing: yes}\n")
    cfg = load_config(path)
    assert [r.steps for r in cfg.rounds] == [5, 9] and cfg.rounds[1].reward.judge.scores == {"yes": 1.0, "no": 0.0}
    assert cfg.sft.gradient_checkpointing is True  # a value reads the word as before
    scores = load_config(None, ['rounds=[{"algorithm": "grpo", "reward": {"source": "judge", "judge": {"model": "j"}}}]',
                                "rounds.0.reward.judge.scores={yes: 2, no: 0}"]).rounds[0].reward.judge.scores
    assert scores == {"yes": 2.0, "no": 0.0}  # an override's mapping keys alike
    path.write_text("sft: {epochs: 1}\nsft: {epochs: 2}\n")
    with pytest.raises(ConfigError, match="found the key 'sft' twice"):
        load_config(path)


def test_an_unknown_key_says_the_nearest_setting_or_its_sections_settings(tmp_path):
    """Pydantic said 'Extra inputs are not permitted' for a misspelt key, with no hint; a check across fields kept
    its 'Value error,' prefix."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rounds.0.algoritm=grpo", 'rounds.1.generation={"tempreature": 0.5}', "sft.zzz=1"])
    lines = str(err.value).splitlines()[1:]
    assert lines[0] == "  sft.zzz: no such setting; valid: batch_size, checkpoint_every, dropout, epochs, " \
        "grad_clip, gradient_checkpointing, learning_rate, log_every, lora, max_steps, micro_batch_size, " \
        "micro_batch_tokens, neftune_alpha, num_workers, objective, offload, packing, packing_max_tokens, placement, " \
        "train_on, warmup_steps, weight_decay, zero_stage (got 1) (from the command line: sft.zzz=1)"
    assert lines[1].startswith("  rounds.0.algoritm: no such setting; did you mean 'algorithm'? (got 'grpo')")
    assert lines[2].startswith("  rounds.1.generation.tempreature: no such setting; did you mean 'temperature'?")
    with pytest.raises(ConfigError) as err:  # a key that is no identifier is named as given
        load_config(None, ["sft={learning-rate: 1e-4}"])
    assert str(err.value).splitlines()[1].startswith("  sft.learning-rate: no such setting; did you mean "
                                                     "'learning_rate'?")
    with pytest.raises(ConfigError) as err:
        load_config(None, ["reward_model=null"])
    assert "Value error" not in str(err.value) and "<root>" not in str(err.value)
    assert str(err.value).endswith("or score with reward.source=rule|remote|process_model and start a critic from "
                                   "the policy (critic.init=policy)")


def test_an_error_names_its_field_and_where_it_was_set(tmp_path):
    """A union field's errors carried pydantic's member tags (`max_prompt_tokens.constrained-int`), so their
    origin was looked up under a name nothing sets ("the default, not set in"); a check across fields reported
    `<root>`, the whole config as the value given, and the file though the command line set the value."""
    path = tmp_path / "union.yaml"
    path.write_text("data: {max_prompt_tokens: 0}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).splitlines()[1:] == [
        f"  data.max_prompt_tokens: Input should be greater than or equal to 1; or Input should be 'auto' (got 0) "
        f"(from {path})"]
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rounds.1.start_from=dpo"])
    assert str(err.value).splitlines()[1:] == [
        "  rounds.1.start_from: 'dpo' is no policy before round_2; valid: base, sft, round_1 (from the command line: "
        "rounds.1.start_from=dpo)"]
