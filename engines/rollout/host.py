"""One process for every evaluation of a run: the rollout engine's libraries load once.

A pipeline evaluates every policy it makes (base, SFT, each round), each
with a rollout engine of its own. On a CPU most of such an engine's start is
the process, not the model: a new Ray actor, then `import vllm` (~6 s on 2
cores), before `LLM()` builds the engine in ~1-2 s. An `EngineHost` is one
Ray actor, started by the flow (tasks/stages/eval_engine.py) while the first stages
train; each `generate` call builds a fresh engine in it for the model and seed
it names, samples, and tears the engine down. A fresh engine means the same
samples as an engine in a process of its own
(tests/engines/rollout/test_rollout_host.py). Calls run one at a time, in the
order they arrive (a Ray actor's default).
"""

from __future__ import annotations

import torch

from alignflow.store.artifacts import Source, local_dir
from engines.lean_imports import import_vllm
from engines.rollout.engine_build import build_engine, prepare_engine_process
from engines.rollout.base import Rollout, Sampling


class EngineHost:
    def __init__(self, backend: str, *, torch_threads: int = 2, cpu_cores: list[int] | None = None,
                 on_gpu: bool = False):
        self.torch_threads = prepare_engine_process(torch_threads, cpu_cores, on_gpu=on_gpu)
        self.engines_built = 0
        if backend == "vllm":
            import_vllm()  # the point of the host: loaded once, before an evaluation asks

    def generate(self, backend: str, model_path: Source, prompt_ids: list[list[int]], sampling: Sampling,
                 **engine_kwargs) -> list[Rollout]:
        """`build_engine(backend, model_path, **engine_kwargs)`, its samples, then the engine torn down."""
        return self._on_fresh_engine(backend, model_path, engine_kwargs, lambda e: e.generate(prompt_ids, sampling))

    def run_episodes(self, backend: str, model_path: Source, records: list[dict], sampling: Sampling, env,
                     **engine_kwargs) -> list[Rollout]:
        """As `generate`, for episodes in the environment `env` (engines/rollout/agentic.py)."""
        from engines.rollout.agentic import episodes_on

        return self._on_fresh_engine(backend, model_path, engine_kwargs, lambda e: episodes_on(
            e, records, sampling, env, engine_kwargs.get("max_model_len", 256)))

    def _on_fresh_engine(self, backend: str, model_path: Source, engine_kwargs: dict, use):
        """`use(engine)` on an engine built for this call, then the engine torn down."""
        torch.set_num_threads(self.torch_threads)  # as a fresh process has it, whatever the last engine set
        engine = build_engine(backend, local_dir(model_path), **engine_kwargs)
        self.engines_built += 1
        try:
            return use(engine)
        finally:
            engine.close()

    def stats(self) -> dict[str, int]:
        """How many engines this process has built (the tests' proof that it was reused)."""
        return {"engines_built": self.engines_built}
