"""Where a policy evaluation's rollout engine runs: the run's engine host, or a process of its own.

Where `evaluation.keeps_engine` holds (engine_lifetime `run`, or `auto` with
no GPU for the engine), the flow starts one EngineHost (engines/rollout/host.py)
for the run before the first stage, if any policy evaluation will compute:
it loads vLLM while SFT trains, and each evaluation builds its engine in it.
It is a named Ray actor owned by the flow's process, so it ends with the flow
on every exit path, and with that process if it is killed. An evaluation that
finds no host (it died) starts an engine of its own, and says so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from alignflow.store.artifacts import ArtifactRef
from alignflow.config import GenerationConfig
from tasks.context import RunContext
from tasks.plan import Plan

log = logging.getLogger("alignflow")
NAMESPACE = "alignflow"
# Where an evaluation's engine ran: the MLflow tag `alignflow.engine_process` of its stage run.
RUN_HOST, OWN_ACTOR = "run host", "own actor"


def host_name(ctx: RunContext) -> str:
    return f"alignflow-engine-host-{ctx.parent_run_id}"


@contextmanager
def engine_host(plan: Plan, ctx: RunContext) -> Iterator[RunContext]:
    """The flow's: `ctx` naming the run's engine host, started here and stopped on the way out;
    `ctx` unchanged where the evaluations do not keep their engine, or none will compute."""
    storage = ctx.storage()
    todo = [s for s in plan.of_kind("evaluate_policy") if not storage.is_committed(storage.stage_uri(s.name, s.key))]
    if not todo or not todo[0].config.evaluation.keeps_engine:
        yield ctx
        return
    import ray

    from engines.placement.devices import actor_options
    from engines.rollout.host import EngineHost
    from engines.rollout.vllm_engine import compiling_env

    g, name = todo[0].config.evaluation.generation, host_name(ctx)
    opts = {**actor_options(g.placement.num_cpus, g.placement.num_gpus, None, g.placement.resources),
            **compiling_env(g.placement.num_gpus > 0)}  # its tensor-parallel engines' workers compile too
    host = ray.remote(**opts)(EngineHost).options(name=name, namespace=NAMESPACE).remote(
        g.backend, torch_threads=ctx.infra.torch_threads, cpu_cores=g.placement.cpu_cores,
        on_gpu=g.placement.num_gpus > 0)
    try:
        yield ctx.model_copy(update={"engine_host": name})
    finally:
        ray.kill(host)


def load_host_modules() -> None:
    """Import what `engine_host` starts the host with (torch among them): the CLI does it before the flow starts,
    so the flow's first stages are not submitted after seconds of imports."""
    import engines.placement.devices  # noqa: F401
    import engines.rollout.host  # noqa: F401
    import engines.rollout.vllm_engine  # noqa: F401


def _find_host(name: str, stage: str):
    import ray

    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        log.warning("%s: the run's engine host %s is gone; this evaluation starts an engine of its own", stage, name)
        return None


def generate(stage: str, g: GenerationConfig, ctx: RunContext, policy: ArtifactRef, prompt_ids: list[list[int]],
             sampling, *, seed: int, dtype: str, max_model_len: int, attn_implementation: str,
             episodes: tuple | None = None) -> tuple[list, str]:
    """`policy`'s rollouts of `prompt_ids` (`episodes` = (records, EnvironmentConfig): episodes of those records
    instead) from a fresh engine seeded with `seed`, and where it ran
    (ENGINE_PROCESSES): built in the run's engine host where there is one, else in a Ray actor of its
    own (gone once they are back)."""
    import ray

    from engines.rollout.actors import start_engines

    host = _find_host(ctx.engine_host, stage) if ctx.engine_host else None
    if host is not None:
        kwargs = dict(dtype=dtype, seed=seed, max_model_len=max_model_len, attn_implementation=attn_implementation,
                      vllm=g.vllm, on_gpu=g.placement.num_gpus > 0)
        if episodes is not None:
            return ray.get(host.run_episodes.remote(g.backend, policy, episodes[0], sampling, episodes[1],
                                                    **kwargs)), RUN_HOST
        return ray.get(host.generate.remote(g.backend, policy, prompt_ids, sampling, **kwargs)), RUN_HOST
    engines = start_engines(g, policy, count=1, seeds=[seed], dtype=dtype, torch_threads=ctx.infra.torch_threads,
                            max_model_len=max_model_len, attn_implementation=attn_implementation)
    try:
        if episodes is not None:
            return engines.collect(engines.submit_episodes(episodes[0], sampling, episodes[1])), OWN_ACTOR
        return engines.generate(prompt_ids, sampling), OWN_ACTOR
    finally:
        engines.shutdown()  # the scorers may need the same GPU
