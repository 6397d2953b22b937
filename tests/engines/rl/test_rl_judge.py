"""A generative judge in real engines: its scores are the verdicts its model gives (recomputed here with a
plain transformers greedy generate), unparsed verdicts counted and given `unparsed_reward`; and a GRPO
step rewarded by it, with the judge's engine in a placement of its own and colocated with the actor."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("warm_actors")]  # engines/placement/warm.py

MAX_NEW = 6
# The tiny model is untrained: its greedy verdicts on these prompts read "?t_" or "?t?" ("?" a replacement
# character). The character after the "t" decides: "_" scores 0.5, and anything else does not parse. Both
# occur (asserted below).
JUDGE = {"pattern": r"t(\S)", "scores": {"_": 0.5}, "unparsed_reward": -5.0,
         "generation": {"backend": "hf", "max_new_tokens": 3}}


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from alignflow.config import SyntheticTaskConfig
    from alignflow.data import synthetic
    from engines.batches import filter_prompts

    data = synthetic.generate(SyntheticTaskConfig(num_sft=1, num_preference=1, num_eval=1, num_rl_prompts=64), seed=0)
    kept, _ = filter_prompts(tokenizer, data["prompts"], 64, "prompts")
    return kept


def plain_verdicts(model_dir, template: str, items, max_new_tokens: int) -> list[str]:
    """Each item's greedy verdict from transformers' own generate (no engine code), one prompt at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    out = []
    for item in items:
        content = template.format(prompt=item.prompt, response=item.response, answer=item.answer or "")
        ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        out.append(tok.decode(gen[0, len(ids):], skip_special_tokens=True))
    return out


def expected_scores(cfg, verdicts: list[str]) -> tuple[list[float], int]:
    from alignflow.config.round.verdicts import parse_verdict

    parsed = [parse_verdict(v, cfg) for v in verdicts]
    return [cfg.unparsed_reward if p is None else p for p in parsed], sum(p is None for p in parsed)


def test_the_judge_scores_what_its_model_answers(ray_local, tiny_model, tokenizer, prompts):
    from alignflow.config.round.judge import JudgeRewardConfig
    from engines.models import load_tokenizer
    from engines.rl.judge import Judge
    from engines.rl.rewards import ScoredText
    from engines.rollout.actors import start_engines

    cfg = JudgeRewardConfig(**JUDGE)
    items = [ScoredText(tokenizer.decode(ids, skip_special_tokens=True), str(d), r["answer"])
             for (ids, r), d in zip(prompts[:12], range(12))]
    engines = start_engines(cfg.generation, str(tiny_model), count=1, seeds=[0], dtype="float32", torch_threads=1,
                            max_model_len=128)
    try:
        scores, metrics = Judge(engines, load_tokenizer(tiny_model), cfg, 128 - 3).score(items)
    finally:
        engines.shutdown()
    verdicts = plain_verdicts(tiny_model, cfg.template, items, 3)
    expected, unparsed = expected_scores(cfg, verdicts)
    assert 0 < unparsed < len(items), f"need parsed and unparsed verdicts: {verdicts}"
    assert scores.tolist() == pytest.approx(expected)
    assert (metrics["judge/unparsed"], metrics["judge/unscored"], metrics["judge/overlong"]) == (unparsed, unparsed, 0)
    assert metrics["judge/verdicts_per_s"] > 0


@pytest.mark.parametrize("colocate_all", [False, True], ids=["own placement", "colocated"])
def test_a_grpo_step_rewarded_by_the_judge(ray_local, tiny_model, tokenizer, prompts, colocate_all):
    """The step's task rewards are the judge's verdicts on its rollouts, as its model gives them; the judge's
    engine runs beside the round's actors, in the round's placement group when colocated."""
    import ray

    from alignflow.config import ActorConfig, PPOConfig, RewardConfig, RolloutConfig, RoundConfig
    from engines.rl.judge import judge_messages  # noqa: F401  (the template the round renders, checked below)
    from engines.rl.rewards import ScoredText
    from engines.rl.round import RLRound
    from engines.rl.round_models import RoundSetup

    cfg = RoundConfig(algorithm="grpo", steps=2, prompts_per_step=4, colocate_all=colocate_all,
                      generation=RolloutConfig(num_samples=2, max_new_tokens=MAX_NEW),
                      reward=RewardConfig(source="judge", judge=JUDGE), ppo=PPOConfig(minibatch_size=8, epochs=1),
                      actor=ActorConfig(learning_rate=1e-3))
    path = str(tiny_model)
    rl = RLRound(cfg, RoundSetup(policy_path=path, reference_path=path, reward_path=None, prompts=prompts,
                                 dtype="float32", torch_threads=1, max_model_len=80, seed=0, judge_path=path,
                                 judge_max_model_len=128))
    try:
        [judge_engine] = rl.models.judge.actors
        report = ray.get(judge_engine.device_report.remote())
        if colocate_all:
            assert report["placement_group"] == rl.models.placement_group.id.hex()
        else:
            assert report["placement_group"] is None and rl.models.placement_group is None
        out = rl.step(0)
    finally:
        rl.shutdown()
    items = [ScoredText(tokenizer.decode(r.prompt_ids, skip_special_tokens=True), r.text,
                        prompts[rl.schedule.indices(0)[r.prompt_index]][1]["answer"]) for r in out.rollouts]
    expected, unparsed = expected_scores(rl.cfg.reward.judge, plain_verdicts(tiny_model, rl.cfg.reward.judge.template,
                                                                               items, 3))
    torch.testing.assert_close(out.experience.task_rewards, torch.tensor(expected), rtol=0, atol=0)
    assert out.metrics["judge/unparsed"] == unparsed
    assert out.metrics["reward/judge"] == pytest.approx(sum(expected) / len(expected))
    # The stage logs the step's metrics under rl/: one named rl/ here reached MLflow as rl/rl/...
    assert not [k for k in out.metrics if k.startswith("rl/")] and ("resident" in out.metrics) == colocate_all


def test_a_rounds_judge_engine_holds_what_its_prompts_can_need(tokenizer, prompts):
    """Not the judge model's whole context (131072 for Llama 3.1, more KV cache than a shared GPU has for one
    sequence): the longest judge prompt with an empty response, the round's most response tokens and a tenth
    more, and the verdict. A judge of another vocabulary, or a max_model_len set, keeps the old answer."""
    import copy

    from alignflow.config.round.judge import JudgeRewardConfig
    from engines.rl.judge import Judge, round_judge_positions
    from engines.rl.rewards import ScoredText, prompt_text

    cfg = JudgeRewardConfig(**JUDGE)
    records = [r for _, r in prompts]
    empty = max(len(ids) for ids in Judge.prompt_ids(tokenizer, cfg, [
        ScoredText(prompt_text(r["prompt"]), "", r.get("answer")) for r in records]))
    kw = dict(judge_tokenizer=tokenizer, policy_tokenizer=tokenizer, records=records, response_tokens=40)
    assert round_judge_positions(131072, cfg, "f", **kw) == empty + 40 + 4 + 3
    assert round_judge_positions(30, cfg, "f", **kw) == 30  # never past the model's
    other = copy.deepcopy(tokenizer)
    other.add_tokens(["<extra_judge_token>"])
    assert round_judge_positions(131072, cfg, "f", **{**kw, "judge_tokenizer": other}) == 131072
    capped = JudgeRewardConfig(**{**JUDGE, "generation": {**JUDGE["generation"], "max_model_len": 90}})
    assert round_judge_positions(131072, capped, "f", **kw) == 90
    # The bound holds: a response of 40 tokens, any of them, fits the longest prompt's judge prompt.
    longest = max(records, key=lambda r: len(prompt_text(r["prompt"])))
    response = tokenizer.decode(tokenizer(" 7 9 3" * 40, add_special_tokens=False)["input_ids"][:40])
    [ids] = Judge.prompt_ids(tokenizer, cfg, [ScoredText(prompt_text(longest["prompt"]), response, longest["answer"])])
    assert len(ids) + 3 <= round_judge_positions(131072, cfg, "f", **kw)
