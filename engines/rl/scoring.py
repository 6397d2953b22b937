"""Frozen models for experience making and evaluation: the reference policy and the reward model.

`ScorerActor` holds either or both, as one Ray actor, on the device its
placement gives it (engines/placement/devices.py). Batches arrive as CPU tensors, run
in micro-batches (`micro_batch_size` rows, `micro_batch_tokens` tokens), and results leave as CPU
tensors. RL rounds and evaluation both score through it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator

import torch

from alignflow.store.artifacts import Source, local_dir
from engines import models
from engines.micro_batching import in_micro_batches
from engines.placement import warm
from engines.placement.devices import (actor_device, actor_options, cpu_report, pin_cpu_cores, placement_group_id,
                                       to_cpu, to_device)
from algos.losses.process import solution_scores
from engines.steps import step_scores
from engines.train.objectives import response_logprobs, scalar_scores

log = logging.getLogger("alignflow")


class ScorerActor:
    """The reference policy (logprobs) and/or the reward model (scores). Whether the two share an
    actor or stand apart is the round's `colocate_reference_and_reward`."""

    def __init__(self, reference_path: Source | None, reward_path: Source | None, dtype: str = "float32",
                 torch_threads: int = 2, attn_implementation: str = "sdpa", micro_batch_size: int | None = None,
                 micro_batch_tokens: int | None = None, cpu_cores: list[int] | None = None,
                 process_path: Source | None = None):
        torch.set_num_threads(pin_cpu_cores(cpu_cores, torch_threads))
        self.device = actor_device()
        self.micro_batch_size, self.micro_batch_tokens = micro_batch_size, micro_batch_tokens
        self.reference = self.reward = self.process = None
        # Refs are fetched on this actor's node (alignflow/store/artifacts.py).
        if reference_path:
            self.reference = models.load_policy(local_dir(reference_path), dtype, attn_implementation).to(self.device).eval()
        if reward_path:
            reward_path = local_dir(reward_path)
            pad = models.load_tokenizer(reward_path).pad_token_id
            self.reward = models.load_scalar_model(reward_path, dtype, pad, attn_implementation).to(self.device).eval()
        if process_path:  # a process reward model: a scalar model read at each step's end (engines/steps.py)
            process_path = local_dir(process_path)
            # the policy's too: a pipeline's PRM trains from its SFT or base model (engines/rl/process.py)
            self.tokenizer = models.load_tokenizer(process_path)
            self.process = models.load_scalar_model(process_path, dtype, self.tokenizer.pad_token_id,
                                                    attn_implementation).to(self.device).eval()

    def _run(self, model, fn, batch: dict[str, torch.Tensor], *, host_each: bool = False) -> torch.Tensor:
        """`fn(model, micro-batch)` over the batch, on this actor's device; the results concatenated on the
        host. `host_each`: each micro-batch's result leaves the device as it comes (a result as large as a
        teacher's top-k of a whole split never gathers there), at a host sync per micro-batch."""
        def one(b):
            out = fn(model, to_device(b, self.device))
            return to_cpu(out) if host_each else out
        return to_cpu(in_micro_batches(batch, self.micro_batch_size, one, tokens=self.micro_batch_tokens))

    @torch.no_grad()
    def ref_logprobs(self, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
        """log π_ref of each response token at `temperature` (the sampler's, `GenerationConfig.logprob_temperature`, where
        they are compared with the policy's at it): (B, T) float32, CPU (batch as engines/rl/experience.py
        builds it)."""
        return self._run(self.reference, functools.partial(response_logprobs, temperature=temperature), batch)

    @torch.no_grad()
    def rewards(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Reward-model score of each sequence: (B,) float32, CPU."""
        return self._run(self.reward, scalar_scores, batch)

    @torch.no_grad()
    def step_rewards(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The process reward model's score at every position: (B, L) float32, CPU; read where the batch's
        step_mask is 1 (engines/steps.py)."""
        return self._run(self.process, step_scores, batch)

    @torch.no_grad()
    def process_rewards(self, batch: dict[str, torch.Tensor], how: str, no_step: float) -> torch.Tensor:
        """Each response's reward from its steps' scores (`algos.solution_scores`, `how`: min, last or mean):
        (B,) float32, CPU; `no_step` for a response without a step."""
        rewards = self._run(self.process, lambda m, b: solution_scores(step_scores(m, b), b["step_mask"], how), batch)
        return torch.where(batch["step_mask"].sum(-1) > 0, rewards, torch.full_like(rewards, no_step))

    def score_rollouts(self, kinds: tuple[str, ...], pad_id: int, temperature: float, process: tuple | None,
                       n_prompts: int, chunks: list[list[int]], *results) -> dict[str, object]:
        """`kinds` (of SCORES_AHEAD) of a generation submitted before this call: Ray hands this actor
        the engines' `results` once they are generated (`submit_scores`). The batch is the one the
        round builds from the same rollouts (engines/rl/experience.py from_rollouts), row for row;
        reference log-probs at `temperature`; a process reward (`process`: the step separator and the
        process_model source) as engines/rl/process.py makes it in the round."""
        from engines.rl.experience import from_rollouts
        from engines.rl.process import process_reward
        from engines.rollout.base import merge_rollouts

        unknown = set(kinds) - set(SCORES_AHEAD)
        if unknown:
            raise ValueError(f"score_rollouts: {sorted(unknown)} not among {SCORES_AHEAD}")
        rollouts = merge_rollouts(n_prompts, chunks, list(results))
        exp = from_rollouts(rollouts, pad_id)
        batch = exp.tensors()
        score = {"ref_logprobs": lambda: self.ref_logprobs(batch, temperature), "rewards": lambda: self.rewards(batch),
                 "process": lambda: process_reward(lambda method, *args: getattr(self, method)(*args), self.tokenizer,
                                                   rollouts, *process, exp.action_mask.shape[1])}
        return {kind: score[kind]() for kind in kinds}

    @torch.no_grad()
    def reference_map(self, batch: dict[str, torch.Tensor], fn) -> torch.Tensor:
        """`fn(reference, micro-batch)` over a batch (e.g. sequence log-probabilities, a teacher's top-k of
        a whole SFT split): one row per batch row, CPU, each micro-batch's rows copied out as they come."""
        return self._run(self.reference, fn, batch, host_each=True)

    def reset(self) -> bool:
        """Nothing to undo: its models are frozen (engines/placement/warm.py keeps it for a start like its own)."""
        return True

    def release_memory(self) -> None:
        """Give the allocator's cached GPU memory back (colocated: before the rollout engines wake their KV
        cache, which vLLM re-maps at the size it measured at start); a no-op on the CPU."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def device_report(self) -> dict:
        """Where each model's parameters live, and the placement group (tests assert them)."""
        return {"placement_group": placement_group_id(), **cpu_report(),
                **{name: sorted({p.device.type for p in m.parameters()})
                   for name, m in (("reference", self.reference), ("reward", self.reward), ("process", self.process))
                   if m is not None}}


SCORES_AHEAD = ("ref_logprobs", "rewards", "process")  # what a scorer can compute before the step that uses it


def scorers_ahead(reference, rewarder, *, reference_on_batch: bool, model_rewards: bool,
                  process=None) -> dict[str, object]:
    """The scorer actors (handles, or None) that can score a step's rollouts while the previous step
    trains (asynchronous rollouts), by what they compute: the reference where the update takes its
    log-probs of the whole batch (`reference_on_batch`), the reward model where it scores the
    rollouts, the process reward model (`process`, an actor of its own) where a source is it. None
    depends on the policy being trained. An actor the update also calls itself
    (the reference of online DPO's pairs) is left out with all it computes: that call would queue
    behind a score of the next step's rollouts, and so wait for their generation."""
    ahead = {} if process is None else {"process": process}
    if reference is not None and reference_on_batch:
        ahead["ref_logprobs"] = reference
    if model_rewards and rewarder is not None and (rewarder is not reference or reference_on_batch):
        ahead["rewards"] = rewarder
    return ahead


def submit_scores(ahead: dict[str, object], pending, pad_id: int, temperature: float,
                  process: tuple | None = None) -> list:
    """Ask each actor of `ahead` (`scorers_ahead`) for its scores of a generation under way
    (`RolloutEngines.submit`'s PendingRollouts), one call per actor, reference log-probs at `temperature`, a
    process reward by `process` (the step separator and the process_model source); each runs once the
    rollouts exist, in the actor's call order. `collect_scores` waits for them."""
    by_actor: dict[int, tuple[object, list[str]]] = {}
    for kind, actor in ahead.items():
        by_actor.setdefault(id(actor), (actor, []))[1].append(kind)
    return [actor.score_rollouts.remote(tuple(kinds), pad_id, temperature, process, pending.n_prompts,
                                        pending.chunks, *pending.refs)
            for actor, kinds in by_actor.values()]


def collect_scores(refs: list, exp) -> dict[str, object]:
    """{kind: scores} of `submit_scores`' calls ({} for none), each checked against the step's batch `exp` (the
    same rollouts, padded alike): tensors, and a process reward (engines/rl/process.py ProcessReward)."""
    import ray

    got = {kind: value for part in (ray.get(refs) if refs else []) for kind, value in part.items()}
    for kind, value in got.items():
        rows = value.sequence if kind == "process" else value  # (B,) or (B, T)
        per_token = [x for x in (rows, getattr(getattr(value, "steps", None), "rewards", None))
                     if x is not None and x.dim() == 2]
        if rows.shape[0] != len(exp) or any(x.shape != exp.action_mask.shape for x in per_token):
            raise RuntimeError(f"{kind} scored ahead has shape {tuple(rows.shape)}; the step's batch is "
                               f"{tuple(exp.action_mask.shape)}")
    return got


def start_scorer(reference_path: Source | None, reward_path: Source | None, *, dtype: str, torch_threads: int,
                 process_path: Source | None = None,
                 attn_implementation: str = "sdpa", micro_batch_size: int | None = None,
                 micro_batch_tokens: int | None = None, num_cpus: float = 1.0, num_gpus: float = 0.0,
                 scheduling_strategy=None, resources: dict[str, float] | None = None, cpu_cores: list[int] | None = None):
    """A ScorerActor on `num_cpus`/`num_gpus` and `resources` (or in a placement group's bundle); inside
    keep_warm() an idle one started with the same arguments (engines/placement/warm.py)."""
    import ray

    opts = actor_options(num_cpus, num_gpus, scheduling_strategy, resources)
    args = (reference_path, reward_path, dtype, torch_threads, attn_implementation, micro_batch_size,
            micro_batch_tokens, cpu_cores, process_path)
    make = lambda: ray.remote(**opts)(ScorerActor).remote(*args)  # noqa: E731
    if scheduling_strategy is not None:  # placed by the caller: not kept warm
        return make()
    return warm.start("scorer", {**opts, "args": args}, make)


@contextlib.contextmanager
def scoring(reference_path: Source | None, reward_path: Source | None, *, num_cpus: float, num_gpus: float,
            resources: dict[str, float] | None = None, cpu_cores: list[int] | None = None,
            **kwargs) -> Iterator[Callable]:
    """`call(method, *args)` on a ScorerActor for the block: with GPUs a Ray actor (killed on exit), pinned to
    `cpu_cores` if given; without them the same class in this process (Ray must be up for the first) (a
    CPU-only actor would only add a process start, ~10-40 s on 2 cores), unpinned, which a warning says.
    `kwargs`: ScorerActor's (dtype, torch_threads, attn_implementation, micro_batch_size, ...)."""
    if num_gpus == 0:
        if cpu_cores:
            log.warning("placement.cpu_cores %s of a scorer is not applied: without GPUs it scores in the task's "
                        "own process, which is not pinned (the scorer's num_gpus > 0 gives it a process)", cpu_cores)
        if resources:
            log.warning("placement.resources %s of a scorer is not applied: without GPUs it scores in the task's "
                        "own process, on the node the task runs on (the scorer's num_gpus > 0 gives it a process "
                        "placed by them)", resources)
        local = ScorerActor(reference_path, reward_path, **kwargs)
        yield lambda method, *args: getattr(local, method)(*args)
        return
    import ray

    actor = start_scorer(reference_path, reward_path, num_cpus=num_cpus, num_gpus=num_gpus, resources=resources,
                         cpu_cores=cpu_cores, **kwargs)
    failed = True  # until the block is done: a call of the actor's may still be running
    try:
        yield lambda method, *args: ray.get(getattr(actor, method).remote(*args))
        failed = False
    finally:
        warm.end(actor, failed=failed)
