"""Rollout engines as Ray actors, and a round's (or an evaluation's) engines as one.

`RolloutActor` hosts one engine (engines/rollout/base.py, built as engines/rollout/engine_build.py says) in
its own process.
`start_engines` starts the configured number: each on its placement, a
tensor-parallel vLLM engine in a placement group of its own (a bundle per
GPU), or where colocation puts it. `RolloutEngines` spreads prompts across
them; weights reach them through engines/transport/sync.py.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from alignflow.store.artifacts import Source, local_dir
from alignflow.config import GenerationConfig, VLLMConfig
from engines.placement import warm
from engines.placement.devices import actor_options
from engines.placement.groups import wait_placement_group
from engines.rollout.base import PendingRollouts, Rollout, Sampling, merge_rollouts
from engines.rollout.engine_build import build_engine, prepare_engine_process
from engines.rollout.pieces import generate_in_pieces
from engines.rollout.texts import response_texts
from engines.rollout.vllm_engine import compiling_env
from engines.transport.sync import announced, announcements, count_in

def _gpu_memory() -> tuple[int, int] | None:
    """(bytes free, bytes in all) of this process's GPU, every process's use counted; None without one."""
    return torch.cuda.mem_get_info() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


class RolloutActor:
    """Hosts one engine in its own process (a Ray actor), for as long as the actor lives."""

    def __init__(self, backend: str, model_path: Source, *, torch_threads: int = 2, dtype: str = "float32",
                 seed: int = 0, max_model_len: int = 256, attn_implementation: str = "sdpa",
                 vllm: VLLMConfig | None = None, on_gpu: bool = False, sleep_mode: bool = False,
                 cpu_cores: list[int] | None = None):
        self._started = (backend, model_path), {k: v for k, v in locals().items() if k not in ("self", "backend",
                                                                                            "model_path")}
        prepare_engine_process(torch_threads, cpu_cores, on_gpu=on_gpu)
        self.engine = build_engine(backend, local_dir(model_path),  # a ref: fetched on this actor's node
                                   dtype=dtype, seed=seed, max_model_len=max_model_len,
                                   attn_implementation=attn_implementation, vllm=vllm, on_gpu=on_gpu,
                                   sleep_mode=sleep_mode)
        self.max_model_len = max_model_len
        self.updates_taken = 0  # weight updates received: the policy version the next generation samples
        self.slept_bytes = 0  # GPU bytes the last sleep gave back
        self.announcements = None  # the weight transport's store, where a published update is announced
        self.ranks = self.world_size = 1  # this engine's ranks in the transport group, and the group's

    def reset(self) -> bool:
        """As the actor started (engines/placement/warm.py): the engine torn down and built again from the same
        arguments (its weights and seed), every count at zero. False where the old engine outlived its close."""
        old = weakref.ref(self.engine)
        self.engine.close()
        del self.engine
        gc.collect()
        args, kwargs = self._started
        self.__init__(*args, **kwargs)
        return old() is None

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, piece_tokens: int | None = None
                 ) -> list[Rollout]:
        """The engine's rollouts, each stamped with the policy version it was sampled from: the number of
        weight updates this engine has taken. `piece_tokens` (partial rollouts): written in pieces, an update
        published meanwhile taken between them (engines/rollout/pieces.py)."""
        if piece_tokens is None:
            return [dataclasses.replace(r, policy_version=self.updates_taken)
                    for r in self.engine.generate(prompt_ids, sampling)]
        return generate_in_pieces(self.engine.generate, prompt_ids, sampling, piece_tokens,
                                  version=lambda: self.updates_taken, take_published=self._take_published,
                                  decode=lambda rs: response_texts(self.engine.tokenizer, [r.prompt_ids for r in rs],
                                                                   [r.token_ids for r in rs]))

    def run_episodes(self, records: list[dict], sampling: Sampling, env) -> list[Rollout]:
        """`sampling.n` episodes of each record in the environment `env` (EnvironmentConfig), each stamped with
        the policy version that sampled it (engines/rollout/episodes.py)."""
        from engines.rollout.agentic import episodes_on

        return [dataclasses.replace(r, policy_version=self.updates_taken)
                for r in episodes_on(self.engine, records, sampling, env, self.max_model_len)]

    def prepare_weights(self, specs: list, bucket_bytes: int) -> list[str | None]:
        gpus = self.engine.prepare_weights(specs, bucket_bytes)
        self.ranks = len(gpus)  # this engine's ranks in the transport group (a tensor-parallel one has several)
        return gpus

    def join_transport(self, address: tuple[str, int], first_rank: int, world_size: int, backend: str) -> None:
        self.engine.join_transport(address, first_rank, world_size, backend)
        self.world_size = world_size
        if backend != "ipc":  # an update published while a generation runs is announced there (pieces.py)
            self.announcements = announcements(address)

    def receive_weights(self, version: int | None = None) -> None:
        """The update that makes this engine's weights `version` (the next where None); nothing where it took
        that one already, between the pieces of a partial rollout. A published update's sender waits for its
        engines to count themselves in (engines/transport/sync.py `publish`)."""
        target = self.updates_taken + 1 if version is None else version
        if target <= self.updates_taken:
            return
        if target != self.updates_taken + 1:
            raise RuntimeError(f"asked for weights version {target}; this engine holds {self.updates_taken}, and "
                               "updates arrive one at a time")
        if self.announcements is not None:
            self.engine.refuse_asleep("update weights", needs=("weights",))  # before it counts itself in
            count_in(self.announcements, target, self.ranks, self.world_size)
        self.engine.receive_weights()
        self.updates_taken = target

    def _take_published(self) -> None:
        """Between two pieces of a partial rollout: an update announced and not yet taken."""
        if self.announcements is not None and announced(self.announcements) > self.updates_taken:
            self.receive_weights(self.updates_taken + 1)

    def sleep(self) -> None:
        before = _gpu_memory()
        self.engine.sleep()
        if before is not None:
            self.slept_bytes = _gpu_memory()[0] - before[0]

    def wake(self, tags: list[str] | None = None) -> None:
        self.engine.wake(tags)

    def memory(self) -> dict[str, int] | None:
        """On a GPU: bytes free on it now, its total, and what this engine's last sleep gave back (what
        waking takes again); None on the CPU."""
        memory = _gpu_memory()
        if memory is None:
            return None
        return {"free": memory[0], "total": memory[1], "slept": self.slept_bytes}

    def events(self) -> dict:
        """What the engine was asked to do, in order and counted (SleepState.events)."""
        return self.engine.events()

    def device_report(self) -> dict:
        """The engine's parameter devices (HF backend) and this actor's placement group."""
        from engines.placement.devices import cpu_report, placement_group_id

        report = getattr(self.engine, "device_report", None)
        return {"placement_group": placement_group_id(), **cpu_report(), **(report() if report else {})}


def start_rollout_actor(backend: str, model_path: Source, *, num_cpus: float = 1.0, num_gpus: float = 0.0,
                        scheduling_strategy=None, resources: dict[str, float] | None = None, **kwargs):
    """One RolloutActor on `num_cpus`/`num_gpus` and `resources` (or where `scheduling_strategy` puts it)."""
    kwargs.setdefault("on_gpu", num_gpus > 0)
    opts = {**actor_options(num_cpus, num_gpus, scheduling_strategy, resources), **compiling_env(kwargs["on_gpu"])}
    make = lambda: ray.remote(**opts)(RolloutActor).remote(backend, model_path, **kwargs)  # noqa: E731
    if scheduling_strategy is not None:  # placed by the caller: not kept warm
        return make()
    return warm.start("rollout", {**opts, **kwargs, "backend": backend, "model_path": model_path}, make)


def engine_bundles(g: GenerationConfig) -> list[dict[str, float]]:
    """The placement group of one tensor-parallel engine: a bundle per GPU, all on one node (STRICT_PACK:
    vLLM's workers read the model from that node's cache). Its first bundle also holds the engine's
    actor (its CPUs, and placement.resources, which pin the node); vLLM places a worker on every bundle."""
    tp = g.vllm.tensor_parallel_size
    return [{"CPU": g.placement.num_cpus, "GPU": 1.0, **g.placement.resources} if i == 0 else {"CPU": 0.0, "GPU": 1.0}
            for i in range(tp)]


class RolloutEngines:
    """The rollout engines of a round or an evaluation, as one: prompts spread across them,
    sleep and wake together (weights reach them through engines/transport/sync.py)."""

    def __init__(self, actors: list, placement_groups: list | None = None):
        self.actors, self.placement_groups, self.failed = actors, placement_groups or [], False

    def taint(self) -> None:
        """A weight transfer into them failed: they end with `shutdown`, not kept warm (engines/placement/warm.py)."""
        self.failed = True

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> list[Rollout]:
        """Rollouts grouped per prompt, in prompt order (prompt i goes to engine i mod k)."""
        return self.collect(self.submit(prompt_ids, sampling))

    def submit(self, prompt_ids: list[list[int]], sampling: Sampling, piece_tokens: int | None = None
               ) -> PendingRollouts:
        """Start generating and return at once; `collect` waits for the rollouts. The engines run
        calls in order, so a weight update submitted later waits for this generation (in pieces of
        `piece_tokens`, an update published meanwhile is taken between them: RolloutActor.generate)."""
        chunks = self._chunks(len(prompt_ids))
        refs = [e.generate.remote([prompt_ids[j] for j in c], sampling, piece_tokens)
                for e, c in zip(self.actors, chunks)]
        return PendingRollouts(len(prompt_ids), chunks, refs)

    def submit_episodes(self, records: list[dict], sampling: Sampling, env) -> PendingRollouts:
        """As `submit`, for episodes in the environment `env` (EnvironmentConfig): record i's on engine i mod k."""
        chunks = self._chunks(len(records))
        refs = [e.run_episodes.remote([records[j] for j in c], sampling, env) for e, c in zip(self.actors, chunks)]
        return PendingRollouts(len(records), chunks, refs)

    def _chunks(self, n: int) -> list[list[int]]:
        """Which of `n` prompts each engine gets: prompt i goes to engine i mod k (engines given none left out)."""
        return [c for c in (list(range(i, n, len(self.actors))) for i in range(len(self.actors))) if c]

    @staticmethod
    def collect(pending: PendingRollouts) -> list[Rollout]:
        return merge_rollouts(pending.n_prompts, pending.chunks, ray.get(pending.refs))

    def sleep(self) -> None:
        ray.get([e.sleep.remote() for e in self.actors])

    def memory(self) -> list[dict[str, int] | None]:
        """Each engine's RolloutActor.memory: its GPU's free and total bytes, and what its last sleep freed."""
        return ray.get([e.memory.remote() for e in self.actors])

    def wake(self, tags: list[str] | None = None) -> None:
        ray.get([e.wake.remote(tags) for e in self.actors])

    def wait_built(self) -> None:
        """Return once every engine is built (an actor's first call waits for its constructor)."""
        ray.get([a.events.remote() for a in self.actors])

    def events(self) -> list[dict]:
        """Each engine's SleepState.events: what it was asked to do, in order, and counted."""
        return ray.get([e.events.remote() for e in self.actors])

    def shutdown(self, failed: bool = False) -> None:
        """End the engines, or inside keep_warm() keep them where no transfer tainted them and their caller's work
        did not fail (`failed`)."""
        for a in self.actors:
            warm.end(a, failed=self.failed or failed)  # ray.kill, or kept for the next start inside keep_warm()
        for pg in self.placement_groups:
            ray.util.remove_placement_group(pg)
        self.actors, self.placement_groups = [], []


def start_engines(g: GenerationConfig, model_path: Source, *, count: int, seeds: list[int], dtype: str,
                  torch_threads: int, max_model_len: int, attn_implementation: str = "sdpa",
                  sleep_mode: bool = False, strategies: list | None = None, one_at_a_time: bool = False
                  ) -> RolloutEngines:
    """`count` engines as `g` configures them. A tensor-parallel vLLM engine gets a placement group
    of its own (a bundle per GPU); `strategies` places the engines instead (colocation). `one_at_a_time`:
    each engine built before the next starts, where two may share a GPU (fractional num_gpus): vLLM sizes
    its KV cache by the GPU memory free while it builds, which another engine's build changes under it."""
    engines = RolloutEngines([])
    common = dict(dtype=dtype, torch_threads=torch_threads, max_model_len=max_model_len,
                  attn_implementation=attn_implementation, vllm=g.vllm, sleep_mode=sleep_mode,
                  on_gpu=g.placement.num_gpus > 0, cpu_cores=g.placement.cpu_cores)
    try:
        for i in range(count):
            if strategies is not None:
                actor = start_rollout_actor(g.backend, model_path, num_cpus=g.placement.num_cpus,
                                            num_gpus=g.placement.num_gpus, scheduling_strategy=strategies[i],
                                            seed=seeds[i], **common)
            elif g.vllm.tensor_parallel_size > 1:
                pg = ray.util.placement_group(engine_bundles(g), strategy="STRICT_PACK")
                engines.placement_groups.append(pg)
                wait_placement_group(pg, f"rollout engine {i} (tensor_parallel_size={g.vllm.tensor_parallel_size})",
                                     "STRICT_PACK")
                strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0,
                                                            placement_group_capture_child_tasks=True)
                actor = start_rollout_actor(g.backend, model_path, num_cpus=g.placement.num_cpus, num_gpus=0,
                                            scheduling_strategy=strategy, seed=seeds[i], **common)
            else:
                actor = start_rollout_actor(g.backend, model_path, num_cpus=g.placement.num_cpus,
                                            num_gpus=g.placement.num_gpus, resources=g.placement.resources,
                                            seed=seeds[i], **common)
            engines.actors.append(actor)
            if one_at_a_time:
                engines.wait_built()
    except BaseException:
        engines.shutdown()
        raise
    return engines
