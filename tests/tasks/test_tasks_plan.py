"""The planner: which stages a config plans, how they are wired, and their keys.

Nothing is started: planning is pure (config in, graph out), and the cache
state is read from a local storage root the tests commit into.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from alignflow.config import load_config
from alignflow.errors import ConfigError
from alignflow.store.storage import Storage
from flows.planview import StageState, plan_states
from tasks.plan import plan_pipeline

GRPO_RULE = '{"algorithm": "grpo", "reward": {"source": "rule"}}'
RS_RULE = '{"algorithm": "rejection_sampling", "reward": {"source": "rule"}}'
PPO = '{"algorithm": "ppo"}'


def _plan(*overrides: str):
    return plan_pipeline(load_config(None, list(overrides)))


def test_default_pipeline_graph():
    plan = _plan()
    assert list(plan.stages) == [
        "base_model", "data", "sft", "reward_model", "round_1", "round_2",
        "eval_base", "eval_sft", "eval_round_1", "eval_round_2", "eval_reward_model",
    ]
    s = plan.stages
    assert s["sft"].inputs == {"data": "data", "init": "base_model"}
    assert s["reward_model"].inputs == {"data": "data", "init": "sft"}
    assert s["round_1"].inputs == {"data": "data", "policy": "sft", "reference": "sft", "reward": "reward_model"}
    assert s["round_2"].inputs["policy"] == "round_1"
    assert s["eval_round_2"].inputs == {"data": "data", "policy": "round_2", "reference": "sft",
                                        "reward": "reward_model"}
    assert plan.skipped == {}
    # every input comes before its consumer
    order = list(s)
    for stage in s.values():
        assert all(order.index(src) < order.index(stage.name) for src in stage.inputs.values()), stage.name


def test_rule_reward_rounds_plan_no_reward_model():
    plan = _plan(f"rounds=[{GRPO_RULE}]")
    assert "reward_model" not in plan.stages and "eval_reward_model" not in plan.stages
    assert "no round scores with it" in plan.skipped["reward_model"]
    assert "reward" not in plan.stages["round_1"].inputs
    assert "reward" not in plan.stages["eval_round_1"].inputs


def test_rounds_of_any_kind_in_any_order():
    plan = _plan(f"rounds=[{GRPO_RULE}, {RS_RULE}, {PPO}]")
    rounds = plan.of_kind("rl_round")
    assert [r.config.round.algorithm for r in rounds] == ["grpo", "rejection_sampling", "ppo"]
    assert [r.inputs["policy"] for r in rounds] == ["sft", "round_1", "round_2"]
    assert "reference" not in plan.stages["round_2"].inputs  # rejection sampling has no KL term
    assert plan.stages["round_3"].inputs["reward"] == "reward_model"  # PPO scores with the reward model
    assert plan.stages["reward_model"].inputs["init"] == "sft"


def test_no_sft_means_rounds_start_from_the_base_model():
    plan = _plan("sft=null", f"rounds=[{GRPO_RULE}]")
    assert "sft" not in plan.stages and "eval_sft" not in plan.stages
    assert plan.stages["round_1"].inputs["policy"] == plan.stages["round_1"].inputs["reference"] == "base_model"
    assert plan.stages["eval_round_1"].inputs["reference"] == "base_model"


def test_ppo_critic_from_the_policy_needs_no_reward_model():
    plan = _plan('rounds=[{"algorithm": "ppo", "critic": {"init": "policy"}, "reward": {"source": "rule"}}]')
    assert "reward_model" not in plan.stages


def test_no_rounds_keeps_the_reward_model_as_a_product():
    plan = _plan("rounds=[]")
    assert {"sft", "reward_model", "eval_reward_model"} <= set(plan.stages)
    assert not plan.of_kind("rl_round")


DPO = '{"loss": "dpo"}'


def test_a_preference_stage_without_rounds_is_sft_preference_evaluation():
    plan = _plan(f"preference={DPO}", "rounds=[]")
    assert list(plan.stages) == ["base_model", "data", "sft", "preference_reference", "preference",
                                 "eval_base", "eval_sft", "eval_dpo"]
    s = plan.stages
    assert s["preference_reference"].inputs == {"data": "data", "reference": "sft"}
    assert s["preference"].inputs == {"data": "data", "init": "sft", "reference": "preference_reference"}
    assert s["eval_dpo"].inputs["policy"] == "preference" and s["eval_dpo"].inputs["reference"] == "sft"
    assert "reward_model" in plan.skipped
    assert list(plan.upto("preference").stages) == ["base_model", "data", "sft", "preference_reference", "preference"]


def test_simpo_gamma_keys_simpo_alone_and_vllm_scheduling_keys_nothing():
    """A setting another loss reads (simpo_gamma) stays out of a DPO stage's key, so adding it kept every DPO
    and KTO key; under simpo it is in. vLLM's async_scheduling says how an engine schedules: in no key."""
    from alignflow.config import cache_relevant

    dpo = load_config(None, [f"preference={DPO}"]).preference
    assert "simpo_gamma" not in cache_relevant(dpo)
    keys = [_plan(f'preference={{"loss": "simpo", "simpo_gamma": {g}}}', "rounds=[]").stages["preference"].key
            for g in (0.5, 1.0)]
    assert keys[0] != keys[1]
    base = _plan()
    switched = _plan("rounds.0.generation.vllm.async_scheduling=true", "evaluation.generation.vllm.async_scheduling=null")
    assert {n: s.key for n, s in base.stages.items()} == {n: s.key for n, s in switched.stages.items()}


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_a_reference_free_preference_loss_has_no_reference_stage(loss):
    plan = _plan(f'preference={{"loss": "{loss}"}}', "rounds=[]")
    assert list(plan.stages) == ["base_model", "data", "sft", "preference", "eval_base", "eval_sft", f"eval_{loss}"]
    assert plan.stages["preference"].inputs == {"data": "data", "init": "sft"}
    assert plan.skipped["preference_reference"] == f"preference.loss {loss} has no reference model"


def test_rounds_after_a_preference_stage_start_from_it():
    plan = _plan('preference={"loss": "kto"}', f"rounds=[{GRPO_RULE}]")
    assert plan.stages["round_1"].inputs["policy"] == plan.stages["round_1"].inputs["reference"] == "preference"
    assert plan.stages["eval_kto"].inputs["policy"] == "preference"
    assert plan.stages["eval_round_1"].inputs["reference"] == "sft"


def test_the_cached_reference_does_not_depend_on_the_loss():
    dpo, kto = _plan(f"preference={DPO}"), _plan('preference={"loss": "kto", "beta": 0.3}')
    assert dpo.stages["preference_reference"].key == kto.stages["preference_reference"].key
    assert dpo.stages["preference"].key != kto.stages["preference"].key
    no_pref = _plan()
    assert all(no_pref.stages[n].key == dpo.stages[n].key for n in ("sft", "reward_model"))
    assert no_pref.stages["round_1"].key != dpo.stages["round_1"].key  # it starts from the DPO policy


def test_no_evaluation():
    plan = _plan("evaluation=null")
    assert not plan.of_kind("evaluate_policy") and not plan.of_kind("evaluate_reward_model")
    assert "evaluation" in plan.skipped


def test_rounds_get_their_resolved_config():
    plan = _plan(f"rounds=[{GRPO_RULE}]")
    kl = plan.stages["round_1"].config.round.kl
    assert (kl.apply_as, kl.estimator) == ("loss", "k3")


def _keys(plan):
    return {name: s.key for name, s in plan.stages.items()}


def test_a_change_reruns_that_stage_and_downstream_only():
    base = _keys(_plan())
    changed = _keys(_plan("sft.learning_rate=0.01"))
    same = {n for n in base if base[n] == changed[n]}
    assert same == {"data", "base_model"}
    later_round = _keys(_plan('rounds=[{}, {"steps": 21}]'))
    assert {n for n in base if base[n] != later_round[n]} == {"round_2", "eval_round_2"}
    only_eval = _keys(_plan("evaluation.num_prompts=10"))
    assert {n for n in base if base[n] != only_eval[n]} == {n for n in base if n.startswith("eval_")} - {
        "eval_reward_model"}


def test_resource_settings_do_not_change_cache_keys():
    base = _keys(_plan())
    moved = _keys(_plan(
        "sft.placement.num_cpus=2", "reward_model.placement.num_gpus=1",
        'rounds=[{"actor": {"placement": {"num_cpus": 3}}, "scorer_placement": {"num_cpus": 2}}, '
        '{"actor": {"freeze_steps": 3}}]',  # the default round 2's one setting
        "infra.torch_threads=1", "infra.keep_warm_s=0", "infra.storage.root=/elsewhere",
        "evaluation.engine_lifetime=stage",  # where the engine runs, not what it samples
        "evaluation.micro_batch_size=8",  # sequences per scoring forward
    ))
    assert moved == base
    # How often a stage saves and logs (checkpointing more often after a crash), and how an engine holds its
    # memory and batches: a stage run with them changed reuses what it committed, and its checkpoints.
    saved = _keys(_plan(
        "sft.checkpoint_every=7", "sft.log_every=3", "reward_model.checkpoint_every=5",
        'rounds=[{"checkpoint_every": 2, "generation": {"weight_bucket_mb": 16, "vllm": {"kv_cache_gib": 2, '
        '"max_num_seqs": 8, "max_num_batched_tokens": 512, "enforce_eager": true}}}, '
        '{"actor": {"freeze_steps": 3}, "colocate_offload": "always"}]',
        "evaluation.generation.vllm.gpu_memory_utilization=0.5",
    ))
    assert saved == base
    assert _keys(_plan("sft.learning_rate=0.01"))["sft"] != base["sft"]  # what it computes still does
    # A trainer's micro-batch is its gradient accumulation: the name kept out of keys under evaluation only
    assert _keys(_plan("sft.micro_batch_size=2"))["sft"] != base["sft"]


def test_the_seed_reaches_every_stage():
    base, other = _keys(_plan()), _keys(_plan("seed=1"))
    assert all(base[n] != other[n] for n in base), "a stage whose key ignores the pipeline seed"
    seeds = {s.name: s.config.seed for s in _plan().stages.values() if hasattr(s.config, "seed")}
    rounds = [seeds["round_1"], seeds["round_2"]]
    assert rounds[0] != rounds[1], "identical rounds drew the same random numbers"
    # policies are evaluated on the same draws
    assert len({seeds[n] for n in seeds if n.startswith("eval_")}) == 1


def test_key_is_a_digest_of_config_inputs_and_code():
    """Recomputed here with hashlib, from what the plan says the stage is."""
    from alignflow.config import cache_relevant

    stage = _plan().stages["sft"]
    blob = json.dumps({"stage": "sft", "config": cache_relevant(stage.config), "inputs": stage.input_keys,
                       "code": stage.code_version}, sort_keys=True, separators=(",", ":"))
    assert stage.key == hashlib.sha256(blob.encode()).hexdigest()[:20]
    assert stage.input_keys == {"data": _plan().stages["data"].key, "init": _plan().stages["base_model"].key}


def test_targets_resolve_to_stages_and_their_needs():
    plan = _plan()
    assert plan.resolve("rl") == ["round_1", "round_2"]
    assert list(plan.upto("sft").stages) == ["base_model", "data", "sft"]
    assert list(plan.upto("round_1").stages) == ["base_model", "data", "sft", "reward_model", "round_1"]
    assert set(plan.upto("evaluation").stages) == set(plan.stages)
    with pytest.raises(ConfigError, match=r"no stage 'sfft' in this pipeline; did you mean 'sft'\? valid: .*sft"):
        plan.upto("sfft")
    with pytest.raises(ConfigError, match=r"no stage 'round1' in this pipeline; did you mean 'round_1'\?"):
        plan.upto("round1")
    no_rm = _plan(f"rounds=[{GRPO_RULE}]")
    with pytest.raises(ConfigError, match="no round scores with it"):
        no_rm.upto("reward_model")
    dpo = _plan("rounds=[]", 'preference={"loss": "dpo"}')  # the targets offered are this pipeline's own
    with pytest.raises(ConfigError) as err:
        dpo.upto("sfft")
    offered = str(err.value).split("valid: ")[1].split(", ")
    assert "preference" in offered and "sft" in offered and not {"rl", "judge", "distill"} & set(offered)


def test_planning_imports_no_engine():
    import subprocess

    code = ("import sys; from alignflow.config import load_config; from tasks.plan import plan_pipeline; "
            "plan_pipeline(load_config()); "
            "print(sorted(m for m in ('torch', 'ray', 'vllm', 'prefect', 'deepspeed', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---- cache state and why ------------------------------------------------------------


def _commit(storage: Storage, stage, tmp_path) -> None:
    """Commit a stage the way compute_stage records it (its config, input keys and code version)."""
    from alignflow.config import cache_relevant

    src = tmp_path / f"src-{stage.name}-{stage.key}"
    src.mkdir()
    (src / "out.txt").write_text(stage.name)
    storage.commit(src, storage.stage_uri(stage.name, stage.key), meta={
        "stage": stage.name, "key": stage.key, "config": cache_relevant(stage.config),
        "input_keys": stage.input_keys, "code_version": stage.code_version})


def test_plan_states_say_cached_or_why(tmp_path):
    storage = Storage(root=str(tmp_path / "artifacts"))
    first = _plan()
    for name in ("base_model", "data", "sft", "reward_model"):
        _commit(storage, first.stages[name], tmp_path)
    states = plan_states(first, storage)
    assert [n for n, st in states.items() if st.cached] == ["base_model", "data", "sft", "reward_model"]
    assert states["round_1"].why == "never committed"

    second = _plan("sft.learning_rate=0.01")
    states = plan_states(second, storage)
    assert states["data"].cached and states["base_model"].cached
    assert states["sft"].why == "config changed: train.learning_rate 0.002 -> 0.01"
    assert states["reward_model"].why == "input changed: init"

    # A committed stage whose file is gone (a lifecycle rule, a cleanup) is not Cached: `alignflow run` of a
    # plan it called all cached printed the old report and never made the file again.
    (Path(storage.stage_uri("data", first.stages["data"].key)) / "out.txt").unlink()
    assert plan_states(first, storage)["data"] == StageState(cached=False, why="files lost since its commit: out.txt")


def test_the_plan_never_shows_a_credential_in_a_url(tmp_path):
    storage = Storage(root=str(tmp_path / "artifacts"))

    def remote(key: str, path: str = "score") -> str:
        return (f'rounds=[{{"algorithm": "grpo", "reward": {{"source": "remote", '
                f'"url": "https://rm.example/{path}?api_key={key}"}}}}]')

    # A manifest committed before configs refused a credential written out holds the URL as written.
    cfg = load_config(None, [remote("${RM_API_KEY}")])
    reward = cfg.rounds[0].reward.model_copy(update={"url": "https://rm.example/score?api_key=OLDKEY"})
    first = plan_pipeline(cfg.model_copy(update={"rounds": [cfg.rounds[0].model_copy(update={"reward": reward})]}))
    _commit(storage, first.stages["round_1"], tmp_path)
    named = plan_states(_plan(remote("${RM_API_KEY}")), storage)["round_1"]
    assert named.why == ("not committed under this key (a credential in the config may have changed: "
                         "none is recorded)")
    moved = plan_states(_plan(remote("${RM_API_KEY}", path="v2/score")), storage)["round_1"].why
    assert moved == ("config changed: round.reward.url 'https://rm.example/score?api_key=***' -> "
                     "'https://rm.example/v2/score?api_key=***'")
    assert "OLDKEY" not in moved


DISTILL = '{"algorithm": "distill", "teacher": "round_2", "start_from": "sft", "reward": {"source": "rule"}}'


def test_a_distillation_round_takes_an_earlier_round_as_its_teacher_and_starts_where_it_is_told():
    plan = _plan(f"rounds=[{PPO}, {PPO}, {DISTILL}]")
    s = plan.stages
    assert s["round_3"].inputs == {"data": "data", "policy": "sft", "teacher": "round_2"}  # no reference, no RM
    assert s["eval_round_3"].inputs["policy"] == "round_3"
    assert s["round_3"].config.round.kl.coef == 0.0  # the teacher's pull is the only one
    order = list(s)
    assert order.index("round_2") < order.index("round_3")


def test_the_students_key_follows_its_teachers():
    base = _keys(_plan(f"rounds=[{PPO}, {PPO}, {DISTILL}]"))
    teacher_changed = _keys(_plan(f'rounds=[{PPO}, {{"algorithm": "ppo", "steps": 21}}, {DISTILL}]'))
    assert {n for n in base if base[n] != teacher_changed[n]} == {"round_2", "eval_round_2", "round_3",
                                                                   "eval_round_3"}


def test_a_teacher_from_outside_the_pipeline_is_committed_by_a_stage_of_its_own(tmp_path):
    from engines.models import build_tiny_model
    from alignflow.config import TinyModelConfig

    teacher = build_tiny_model(TinyModelConfig(), seed=3, out_dir=tmp_path / "teacher")
    rounds = f'rounds=[{{"algorithm": "distill", "teacher": "{teacher}", "reward": {{"source": "rule"}}}}]'
    plan = _plan(rounds, f"infra.storage.cache_dir={tmp_path / 'cache'}")
    s = plan.stages
    assert s["teacher_1"].kind == "base_model" and s["teacher_1"].config.model.base == str(teacher)
    assert s["round_1"].inputs == {"data": "data", "policy": "sft", "teacher": "teacher_1"}
    assert "rounds.0.teacher" in s["teacher_1"].input_keys
    before = s["round_1"].key
    (teacher / "config.json").write_text((teacher / "config.json").read_text() + "\n")  # the teacher's files change
    again = _plan(rounds, f"infra.storage.cache_dir={tmp_path / 'cache'}").stages
    assert again["teacher_1"].key != s["teacher_1"].key and again["round_1"].key != before


@pytest.mark.parametrize("rounds, message", [
    ('[{"algorithm": "distill", "reward": {"source": "rule"}}]', "distill needs a teacher"),
    ('[{"algorithm": "grpo", "teacher": "sft", "reward": {"source": "rule"}}]', "teacher is read by algorithm distill"),
    ('[{"algorithm": "distill", "teacher": "round_2", "reward": {"source": "rule"}}, {}]',
     "rounds.0.teacher: 'round_2' names no policy before round_1"),
    ('[{"algorithm": "distill", "teacher": "sft", "reward": {"source": "rule"}}]',
     "rounds.0.teacher: 'sft' is the policy round_1 starts from"),
    ('[{}, {"start_from": "round_2"}]', "rounds.1.start_from: 'round_2' is no policy before round_2; valid: base, "
     "sft, round_1"),
    ('[{"algorithm": "distill", "teacher": "base", "kl": {"coef": 0.1}, "reward": {"source": "rule"}}]',
     "there is no separate KL term; leave out kl"),
    ('[{}, {"reference": "round_2"}]', "rounds.1.reference: 'round_2' is no policy before round_2; valid: base, "
     "sft, round_1, start"),
    ('[{"algorithm": "rejection_sampling", "reference": "start"}]', "reference: rejection_sampling has none"),
    ('[{"algorithm": "distill", "teacher": "base", "reference": "sft", "reward": {"source": "rule"}}]',
     "reference: distill has none"),
    ('[{"algorithm": "grpo", "kl": {"coef": 0}, "reference": "start"}]',
     "reference: grpo reads none with kl.coef 0 (no KL term): leave reference out"),
])
def test_a_wrong_teacher_or_start_is_named_with_its_field(rounds, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _plan(f"rounds={rounds}")


def test_a_teacher_with_another_vocabulary_is_refused_naming_its_field(tmp_path):
    from alignflow.config import TinyModelConfig
    from engines.models import build_tiny_model, load_tokenizer
    from tasks.stages.rl_round import same_vocabulary

    student = load_tokenizer(build_tiny_model(TinyModelConfig(), seed=0, out_dir=tmp_path / "s"))
    same_vocabulary(student, load_tokenizer(build_tiny_model(TinyModelConfig(), seed=5, out_dir=tmp_path / "t")),
                    "rounds.2.teacher")  # another initialisation, the same tokenizer: accepted
    other = load_tokenizer(tmp_path / "s")
    other.add_tokens(["<tool>"])
    with pytest.raises(ConfigError, match=r"rounds.2.teacher: its tokenizer is not the student's \(\d+ against \d+"):
        same_vocabulary(student, other, "rounds.2.teacher")


def test_a_teacher_that_cannot_score_the_students_sequences_is_refused_naming_its_field(tmp_path):
    """Past its positions a teacher's log-probs are silently wrong (RoPE); an id of the student's padded output
    rows past the teacher's crashes its gather (on a GPU, a device-side assert)."""
    import json

    from alignflow.config import TinyModelConfig
    from engines.models import build_tiny_model
    from tasks.stages.rl_round import teacher_fits

    student = build_tiny_model(TinyModelConfig(), seed=0, out_dir=tmp_path / "s")
    teacher = build_tiny_model(TinyModelConfig(max_position_embeddings=64), seed=1, out_dir=tmp_path / "t")
    teacher_fits(student, teacher, 64, "rounds.1.teacher", sampled=True)  # fits exactly
    with pytest.raises(ConfigError, match=r"rounds.1.teacher: the teacher takes 64 positions, .* up to 100 tokens"):
        teacher_fits(student, teacher, 100, "rounds.1.teacher", sampled=True)
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    (tmp_path / "s" / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))
    with pytest.raises(ConfigError, match=r"output layer has \d+ rows, the student's \d+"):
        teacher_fits(student, teacher, 64, "rounds.1.teacher", sampled=True)
    teacher_fits(student, teacher, 64, "distill.teacher", sampled=False)  # scores its own top-k: ids it has


JUDGED = '{"algorithm": "grpo", "reward": {"source": "judge"}}'


def test_a_judge_section_plans_the_judge_from_sft_its_evaluation_and_the_rounds_that_ask_it():
    plan = _plan("judge={}", f"rounds=[{JUDGED}, {GRPO_RULE}]")
    s = plan.stages
    assert s["judge"].inputs == {"data": "data", "init": "sft"}
    assert s["round_1"].inputs["judge"] == "judge" and "judge" not in s["round_2"].inputs
    assert s["eval_judge"].inputs == {"data": "data", "judge": "judge"}
    assert "reward_model" not in s  # the judge is the round's only scorer of answers
    changed = _keys(_plan('judge={"epochs": 2}', f"rounds=[{JUDGED}, {GRPO_RULE}]"))
    assert {n for n, k in _keys(plan).items() if changed[n] != k} == {"judge", "eval_judge", "round_1",
                                                                      "eval_round_1", "round_2", "eval_round_2"}


def test_a_judge_of_the_users_is_committed_by_a_stage_of_its_own(tmp_path):
    from alignflow.config import TinyModelConfig
    from engines.models import build_tiny_model

    judge = build_tiny_model(TinyModelConfig(), seed=4, out_dir=tmp_path / "judge")
    rounds = f'rounds=[{{"algorithm": "grpo", "reward": {{"source": "judge", "judge": {{"model": "{judge}"}}}}}}]'
    s = _plan(rounds, f"infra.storage.cache_dir={tmp_path / 'cache'}").stages
    assert "judge" not in s and s["round_1"].inputs["judge"] == "judge_model_1"
    assert s["judge_model_1"].kind == "base_model" and "rounds.0.reward.judge.model" in s["judge_model_1"].input_keys


def test_offline_distillation_caches_its_teacher_apart_from_its_training():
    rounds = f"rounds=[{PPO}, {PPO}]"
    plan = _plan(rounds, 'distill={"teacher": "round_2"}')
    s = plan.stages
    assert s["distill_teacher"].inputs == {"data": "data", "student": "sft", "teacher": "round_2"}
    assert s["distill"].inputs == {"data": "data", "init": "sft", "teacher": "distill_teacher"}
    assert s["eval_distill"].inputs["policy"] == "distill"
    assert {"round_2", "distill_teacher", "distill"} <= set(plan.upto("distill").stages)
    base = _keys(plan)
    lr = _keys(_plan(rounds, 'distill={"teacher": "round_2", "learning_rate": 0.01}'))
    assert {n for n in base if base[n] != lr[n]} == {"distill", "eval_distill"}  # the teacher is not run again
    mb = _keys(_plan(rounds, 'distill={"teacher": "round_2", "micro_batch_size": 2, "micro_batch_tokens": 64}'))
    assert {n for n in base if base[n] != mb[n]} == {"distill", "eval_distill"}  # its micro-batches are resources
    k = _keys(_plan(rounds, 'distill={"teacher": "round_2", "top_k": 5}'))
    assert {n for n in base if base[n] != k[n]} == {"distill_teacher", "distill", "eval_distill"}
    other = _keys(_plan(rounds, 'distill={"teacher": "round_1"}'))
    assert other["distill_teacher"] != base["distill_teacher"]


@pytest.mark.parametrize("distill, message", [
    ('{"teacher": "round_3"}', "distill.teacher: 'round_3' names no policy of this pipeline"),
    ('{"teacher": "sft"}', "'sft' is the policy the distill stage starts from"),
    ('{"teacher": "round_1", "packing": true}', "leave packing off"),
])
def test_a_wrong_offline_distillation_is_named(distill, message):
    with pytest.raises(ConfigError, match=message):
        _plan(f"rounds=[{PPO}]", f"distill={distill}")


@pytest.mark.parametrize("preference", [False, True])
def test_the_configs_lora_reference_reading_is_the_plans(preference):
    """PipelineConfig.reference_is_actor (which placements flash-attn's check reads) says a round's reference
    is its own actor exactly where the plan hands the round the same checkpoint as policy and reference
    (what the round compares when it starts)."""
    import json

    lora = {"algorithm": "grpo", "reward": {"source": "rule"}, "kl": {"coef": 0.05}, "actor": {"lora": {"rank": 4}}}
    rounds = [lora, lora, {**lora, "start_from": "base"}, {**lora, "start_from": "dpo" if preference else "sft"},
              {**lora, "reference": "start"}, {**lora, "start_from": "base", "reference": "base"},
              {**lora, "reference": "round_1"}]
    cfg = load_config(None, [f"rounds={json.dumps(rounds)}", *(['preference={"loss": "dpo"}'] if preference else [])])
    stages = plan_pipeline(cfg).stages
    same = [stages[f"round_{i + 1}"].inputs["policy"] == stages[f"round_{i + 1}"].inputs["reference"]
            for i in range(len(rounds))]
    assert same == [cfg.reference_is_actor(i) for i in range(len(rounds))] == [True, False, False, True, True, True,
                                                                                False]


def test_a_rounds_reference_is_the_policy_it_names_or_its_own_start():
    """ProRL's reference reset: `reference: start` pulls each round toward the policy it starts from; a name,
    toward that policy; without one, every round keeps the policy the rounds started from (SFT here), and the
    round's key does not change for the new field."""
    plain = _plan("rounds=[{}, {}, {}]").stages
    reset = _plan('rounds=[{}, {"reference": "start"}, {"reference": "round_1", "start_from": "sft"}]').stages
    assert [plain[f"round_{i}"].inputs["reference"] for i in (1, 2, 3)] == ["sft"] * 3
    assert [reset[f"round_{i}"].inputs["reference"] for i in (1, 2, 3)] == ["sft", "round_1", "round_1"]
    assert reset["round_3"].inputs["policy"] == "sft"
    assert reset["round_1"].key == plain["round_1"].key and reset["round_2"].key != plain["round_2"].key
    assert reset["eval_round_2"].inputs["reference"] == "sft"  # evaluation measures the KL to SFT, as before
