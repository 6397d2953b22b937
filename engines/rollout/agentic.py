"""Episodes of either kind on a rollout engine: an environment's, stepped by engines/rollout/episodes.py, or a
user's agent driving them through the endpoint of engines/rollout/endpoint.py:

    def agent(client: openai.OpenAI, sample: dict) -> float:
        reply = client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...                                   # call tools, ask again, as the agent's own code decides
        return reward

Each episode runs `agent(client, sample)` in a thread of its own, beside the others, with a client of its own
episode's URL. An agent that raises or spends more than `step_timeout_s` of its own time (outside its requests,
whose wait for a busy engine is not the agent's) fails its episode (counted, `failure_reward`); its reward is
otherwise the episode's return. One that raises at a refusal of the limits
gets failure_reward, truncated still, not failed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from engines.rollout.base import Rollout, Sampling
from engines.rollout.endpoint import ChatEndpoint, EngineLoop
from engines.rollout.episode_tokens import EpisodeTokens, ServedSequence
from engines.rollout.episodes import EPISODE_STATS, EpisodeLimits, in_thread, last_sampled, run_episodes


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


REQUEST_TIMEOUT_S = 600.0  # an agent's client's wait for one completion: only a stuck engine reaches it


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


def episode_prompts(tokenizer, env, records: list[dict]) -> tuple[Callable[[dict], list[int]], int]:
    """(each record's prompt ids as its episodes start (`episode_start`), rendered once here; how much longer
    they are than the prompts the data stage measured with each record's own "tools"): the second is the
    environment's tool schemas, listed in every prompt, the most any record grows. The prompt limit the data
    stage settled (`auto`: its longest prompt) would otherwise leave out every prompt within that many tokens of
    it. An agent's episodes start with the record's own tools: 0."""
    from engines.batches import render_prompt

    start = episode_start(tokenizer, env)
    if env.agent:
        return start, 0
    ids = {id(r): start(r) for r in records}  # the records stay alive in `records`: their ids are theirs
    grown = [len(ids[id(r)]) - len(render_prompt(tokenizer, r["prompt"], r.get("tools"))) for r in records]
    return (lambda r: ids[id(r)] if id(r) in ids else start(r)), max(grown + [0])


def agent_episodes(engine, tokenizer, records: list[dict], n: int, sampling: Sampling, agent, decode,
                   limits: EpisodeLimits) -> list[Rollout]:
    """`n` episodes of each record, each `agent(client, record)` against this engine's endpoint; grouped per
    record, in order, as `run_episodes` returns them. A request the limits leave no turn for is refused and
    truncates its episode; `limits.step_timeout_s` bounds the agent's own time in it (episodes.py RequestClock),
    and a request's wait for the engine REQUEST_TIMEOUT_S (a safety net: a turn is bounded by its tokens)."""
    import openai

    timeout_s, failure_reward = limits.step_timeout_s, limits.failure_reward
    loop = EngineLoop(engine)
    endpoint = ChatEndpoint(loop, tokenizer, decode, limits, temperature=sampling.temperature, top_p=sampling.top_p)
    clients: dict = {}
    names = [f"{i}-{j}" for i in range(len(records)) for j in range(n)]
    try:
        # trust_env=False: an HTTP(S)_PROXY of the cluster's would take the loopback requests (and the key) away
        clients.update({name: openai.OpenAI(base_url=endpoint.url(name), api_key=endpoint.key, max_retries=0,
                                            timeout=REQUEST_TIMEOUT_S,
                                            http_client=openai.DefaultHttpxClient(trust_env=False))
                        for name in names})
        started = time.monotonic()
        runs = {name: in_thread(agent, clients[name], records[i // n]) for i, name in enumerate(names)}

        def over(name: str) -> bool:
            return endpoint.clock.agent_seconds(name, started) > timeout_s

        loop.run(lambda: all(f.done() or over(name) for name, f in runs.items()))
        outcomes = {}
        for name, future in runs.items():
            try:
                reward = float(future.result(timeout=0.0))
                outcomes[name] = (reward, None) if math.isfinite(reward) else \
                    (failure_reward, f"agent returned a reward of {reward}")  # NaN would spread to the whole step
            except Exception as e:  # raised, or still running past its time (its thread is left behind)
                why = f"agent ran past step_timeout_s={timeout_s:g} of its own time" if not future.done() else \
                    f"agent raised {type(e).__name__}: {e}"
                outcomes[name] = (failure_reward, why)
    finally:
        loop.close()  # late requests are refused from here on
        endpoint.close()
        for client in clients.values():
            client.close()
    sequences, all_stats = endpoint.snapshot()
    rollouts = []
    for i, name in enumerate(names):
        reward, error = outcomes[name]
        seq, silent = sequences.get(name), name not in sequences and error is None
        if seq is None:  # the agent asked for nothing (counted where it returned a reward all the same)
            seq = ServedSequence([], EpisodeTokens(tokenizer).start([{"role": "user", "content": ""}]))
        stats = {k: 0 for k in EPISODE_STATS} | all_stats.get(name, {}) | {"no_requests": int(silent)}
        # A limit refused a request (stats["truncated"]): the episode is truncated, not failed, even where the
        # agent raised at the refusal (its return is then failure_reward; the error stays in its transcript).
        limited = bool(stats.get("truncated", 0))
        stats |= {"return": reward, "failed": int(error is not None and not limited), "truncated": int(seq.last_cut or
                  limited), "success": int(error is None and reward > 0 and not limited)}
        rollouts.append(Rollout(prompt_index=i // n, prompt_ids=seq.prompt_ids, token_ids=seq.tokens,
                                text=seq.last_text, logprobs=seq.logprobs,
                                finished=not stats["truncated"], sampled=seq.sampled,
                                turn_rewards=[(last_sampled(seq.sampled), reward)],
                                episode={**stats, "error": error}))
    return rollouts
