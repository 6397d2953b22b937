"""Content keys of every stage, computed before anything runs.

A key covers the stage's config, the keys of its inputs and the stage's
code version: change a stage's config and it and everything downstream gets
new keys (and reruns); nothing upstream does.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from alignflow.config import PipelineConfig, cache_relevant
from alignflow.storage import content_key
from tasks import base_model, data, evaluate, rl_round, train

class StageKeys(BaseModel):
    model_config = ConfigDict(frozen=True)

    data: str
    base_model: str
    sft: str
    reward_model: str
    rounds: list[str]
    eval_reward_model: str
    eval_policy: dict[str, str]


def plan_keys(cfg: PipelineConfig) -> StageKeys:
    lengths = {"max_prompt_tokens": cfg.data.max_prompt_tokens, "max_response_tokens": cfg.data.max_response_tokens}
    k_data = content_key("data", cfg.data, {}, data.CODE_VERSION)
    k_base = content_key("base_model", cfg.model, {}, base_model.CODE_VERSION)
    train_inputs = {"data": k_data, "dtype": cfg.model.dtype, **{k: str(v) for k, v in lengths.items()}}
    k_sft = content_key("sft", cache_relevant(cfg.sft), {**train_inputs, "init": k_base}, train.CODE_VERSION)
    k_rm = content_key("reward_model", cache_relevant(cfg.reward_model), {**train_inputs, "init": k_sft}, train.CODE_VERSION)
    rounds, start = [], k_sft
    for i, rcfg in enumerate(cfg.rounds, start=1):
        start = content_key(f"round_{i}", cache_relevant(rcfg), {**train_inputs, "policy": start, "reference": k_sft, "reward": k_rm},
                            rl_round.CODE_VERSION)
        rounds.append(start)
    policy_keys = {"base": k_base, "sft": k_sft, **{f"round_{i}": k for i, k in enumerate(rounds, start=1)}}
    eval_inputs = {"data": k_data, "reward": k_rm, "reference": k_sft, **{k: str(v) for k, v in lengths.items()}}
    return StageKeys(
        data=k_data, base_model=k_base, sft=k_sft, reward_model=k_rm, rounds=rounds,
        eval_reward_model=content_key("eval_reward_model", {}, {"reward": k_rm, "data": k_data}, evaluate.CODE_VERSION),
        eval_policy={
            name: content_key(f"eval_{name}", cache_relevant(cfg.evaluation), {**eval_inputs, "policy": k}, evaluate.CODE_VERSION)
            for name, k in policy_keys.items()
        },
    )
