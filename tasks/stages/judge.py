"""judge, evaluate_judge: a generative judge trained by SFT on verdicts, and its held-out verdict accuracy.

The judge learns, from each preference pair, two examples: the judge's prompt (judge.template with the
pair's prompt, a response and the answer where the data has one) followed by `yes` for the chosen
response and `no` for the rejected one. It starts from SFT (or the base model). Its evaluation asks it,
greedily, about both responses of every held-out pair, as a round would (engines/rl/judge.py): verdict
accuracy over those 2N verdicts, a verdict that does not parse counting as wrong and counted.
"""

from __future__ import annotations

import json

from alignflow.cluster import ensure_ray
from alignflow.config.round.judge import VERDICTS
from alignflow.records import StageResult
from alignflow.seeds import derive_seed
from alignflow.config.round.verdicts import parse_verdict
from engines import batches, models
from engines.rl.judge import Judge, judge_messages
from engines.rl.rewards import ScoredText, prompt_text
from engines.rollout.actors import start_engines
from engines.train import objectives
from tasks.context import RunContext, StageOutput, compute_stage
from tasks.stages.data import load_split
from tasks.plan import PlannedStage
from tasks.registry import JudgeEvalInputs, JudgeEvalStage, TrainInputs
from tasks.stages.train import causal_lm_objective, train_stage

VERDICT_TOKENS = 4  # room for a verdict word and EOS


def judged_pairs(records: list[dict]) -> list[tuple[ScoredText, bool]]:
    """Both responses of every pair, each with whether it is the right one (the chosen), chosen first."""
    out = []
    for r in records:
        prompt = prompt_text(r["prompt"])
        for response, right in ((r["chosen"], True), (r["rejected"], False)):
            out.append((ScoredText(prompt, response, r.get("answer")), right))
    return out


def verdict_records(records: list[dict], template: str) -> list[dict]:
    """SFT records of the judge: its prompt for each response of each pair, and the verdict."""
    return [{"prompt": judge_messages(template, item), "response": VERDICTS[right]}
            for item, right in judged_pairs(records)]


def judge(stage: PlannedStage, inputs: TrainInputs, ctx: RunContext) -> StageResult:
    """SFT on verdicts; judge prompts longer than the model's positions leave room for are counted and
    left out (`preference/overlong`)."""
    positions = models.max_positions(ctx.tokenizer_dir(inputs.init))
    template = stage.config.train.template

    def to_tensors(tokenizer, records, limits):
        return batches.sft_tensors(tokenizer, verdict_records(records, template), positions - VERDICT_TOKENS,
                                   VERDICT_TOKENS)

    return train_stage(stage, inputs, ctx, kind="causal", split="preference",
                       objective=causal_lm_objective(stage.config.train), weigh=objectives.response_tokens,
                       paired=False, to_tensors=to_tensors)


def evaluate_judge(stage: PlannedStage, inputs: JudgeEvalInputs, ctx: RunContext) -> StageResult:
    cfg: JudgeEvalStage = stage.config

    def compute(output: StageOutput, run) -> dict[str, float]:
        pairs = judged_pairs(load_split(inputs.data, ctx, "eval_preference"))
        judge_dir = ctx.tokenizer_dir(inputs.judge)
        tokenizer, g, items = models.load_tokenizer(judge_dir), cfg.judge.generation, [item for item, _ in pairs]
        ids = Judge.prompt_ids(tokenizer, cfg.judge, items)
        # The engine holds what these prompts need, not the model's whole context: vLLM reserves KV cache for
        # one sequence of max_model_len to start (a long-context judge's would not fit a shared GPU).
        positions = min(models.max_positions(judge_dir), max(map(len, ids), default=0) + g.max_new_tokens)
        ensure_ray(ctx.infra)
        engines = start_engines(g, ctx.ref(inputs.judge), count=1, seeds=[derive_seed(cfg.seed, "judge")],
                                dtype=cfg.io.dtype, torch_threads=ctx.infra.torch_threads, max_model_len=positions,
                                attn_implementation=cfg.io.attn_implementation)
        try:
            judge_ = Judge(engines, tokenizer, cfg.judge, positions - g.max_new_tokens)
            texts, overlong = judge_.verdicts(items, ids)
        finally:
            engines.shutdown()
        right = {True: cfg.judge.scores[VERDICTS[True]], False: cfg.judge.scores[VERDICTS[False]]}
        correct = unparsed = 0
        for (_, is_right), votes in zip(pairs, texts):
            parsed = [parse_verdict(t, cfg.judge) for t in votes]
            unparsed += sum(v is None for v in parsed)
            correct += sum(v == right[is_right] for v in parsed)
        n = sum(len(v) for v in texts) + overlong
        metrics = {"eval/judge_verdict_accuracy": correct / n, "eval/judge_unparsed": float(unparsed),
                   "eval/judge_overlong": float(overlong), "eval/judge_verdicts": float(n),
                   "eval/judge_positions": float(positions)}
        run.log_metrics(metrics)
        samples = [{"prompt": item.prompt, "response": item.response, "right": is_right, "verdicts": votes}
                   for (item, is_right), votes in list(zip(pairs, texts))[:20]]
        run.log_dict(samples, "samples/judge.json")
        (output.dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
        return metrics

    return compute_stage(ctx, stage, compute)
