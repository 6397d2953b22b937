"""Episodes of either kind on a rollout engine: an environment's, stepped by engines/rollout/episodes.py, or a
user's agent driving them through the endpoint of engines/rollout/endpoint.py."""

from __future__ import annotations

from collections.abc import Callable

from engines.rollout.base import Rollout, Sampling
from engines.rollout.endpoint import agent_episodes
from engines.rollout.episode_tokens import EpisodeTokens
from engines.rollout.episodes import EpisodeLimits, run_episodes


def episodes_on(engine, records: list[dict], sampling: Sampling, env, max_model_len: int) -> list[Rollout]:
    """`sampling.n` episodes of each record on `engine`, in the environment `env` (EnvironmentConfig) names."""
    from alignflow.agents.environment import as_messages, make_environment
    from alignflow.config.loading import load_callable

    engine._awake("generate", needs=engine.TAGS)
    tok, per_turn = engine.tokenizer, env.turn_tokens(sampling.max_new_tokens)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731  (a turn's text, as its reader sees it)
    limits = EpisodeLimits(max_turns=env.max_turns, max_tokens_per_turn=per_turn,
                           max_episode_tokens=env.max_episode_tokens, max_model_len=max_model_len,
                           step_timeout_s=env.step_timeout_s, failure_reward=env.failure_reward)
    if env.agent is not None:  # the user's agent drives each episode through the endpoint, in the same limits
        return agent_episodes(engine, tok, records, sampling.n, sampling, load_callable(env.agent, "environment.agent"),
                              decode, limits)
    return run_episodes(engine, tok, records, sampling.n, sampling, lambda: make_environment(env.name, env.kwargs),
                        limits, decode)


def episode_start(tokenizer, env) -> Callable[[dict], list[int]]:
    """A record's prompt ids as the episodes of `env` (EnvironmentConfig) start: its prompt as chat messages (a
    string is one user turn, as ToolEnvironment.reset makes it) rendered with the environment's tool schemas,
    or for an agent's episodes with the record's own "tools". What a round's and an evaluation's prompt limit
    measures. An environment whose reset writes another first observation starts elsewhere: its episodes find
    their room when they start (one with none is truncated before its first turn, counted and named)."""
    from alignflow.agents.environment import as_messages, make_environment

    schemas = None if env.agent else [t.schema for t in make_environment(env.name, env.kwargs).tools] or None
    own = EpisodeTokens(tokenizer, schemas)

    def start(record: dict) -> list[int]:
        tokens = EpisodeTokens(tokenizer, record.get("tools")) if env.agent else own
        return tokens.start(as_messages(record["prompt"]))

    return start
