"""The evaluation engine host: one process, a fresh engine per call, the samples of an engine of its own."""

from __future__ import annotations

import pytest
import ray

from alignflow.config import TinyModelConfig
from engines import models
from engines.rollout.actors import start_rollout_actor
from engines.rollout.base import Sampling
from engines.rollout.host import EngineHost

pytestmark = pytest.mark.engine

SAMPLING = Sampling(n=3, temperature=1.0, max_new_tokens=6)
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """The tiny policy's architecture and tokenizer, other weights."""
    return models.build_tiny_model(TinyModelConfig(), seed=1, out_dir=tmp_path_factory.mktemp("host-other"))


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(t)["input_ids"] for t in ("Which digit is largest? 3 1 4", "hello", "9 2 7 5")]


def _samples(rollouts) -> list[tuple[list[int], list[float]]]:
    return [(r.token_ids, [round(lp, 5) for lp in r.logprobs]) for r in rollouts]


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_host_samples_as_an_engine_of_its_own_would(ray_local, backend, tiny_model, other_model, prompts):
    """Three evaluations (a model, another, the first again) in one host process draw exactly what
    three fresh processes draw: no state of one engine reaches the next."""
    calls = [(tiny_model, 3), (other_model, 5), (tiny_model, 3)]
    host = ray.remote(num_cpus=1)(EngineHost).remote(backend, torch_threads=1)
    try:
        hosted = [_samples(ray.get(host.generate.remote(backend, str(m), prompts, SAMPLING, seed=s,
                                                         max_model_len=MAX_MODEL_LEN)))
                  for m, s in calls]
        assert ray.get(host.stats.remote()) == {"engines_built": 3}
        if backend == "vllm":
            seen = ray.get(host.__ray_call__.remote(_a_build_seen_from_inside, str(tiny_model)))
            # Garbage from before the build is not what the build's collections scan; closing frees it, in one
            # full collection, not three (vLLM's shutdown's two, then one more: engines/heap.py).
            assert seen["old_garbage_during_build"] == "alive" and seen["old_garbage_after_close"] == "collected"
            assert seen["full_collections_at_close"] == 1, seen
            # The KV cache holds vLLM's default 256 sequences of MAX_MODEL_LEN (in whole blocks of 128) and the
            # block vLLM keeps back, by vLLM's own count of its blocks: not the 1 GiB vllm.kv_cache_gib allows.
            assert seen["kv_tokens"] == (256 + 1) * 128, seen
    finally:
        ray.kill(host)
    # The second engine is the one that could inherit the first's state; a fresh process draws the reference.
    actor = start_rollout_actor(backend, str(other_model), num_cpus=1, torch_threads=1, seed=5,
                                max_model_len=MAX_MODEL_LEN)
    try:
        own = _samples(ray.get(actor.generate.remote(prompts, SAMPLING)))
    finally:
        ray.kill(actor)
    assert hosted[1] == own
    assert hosted[2] == hosted[0]
    assert hosted[1] != hosted[0]  # the comparison can tell models apart


def _a_build_seen_from_inside(host: EngineHost, model_path: str) -> dict:
    """In the host's process: a cycle that became garbage before an engine's build, looked at as the engine
    samples and after it closed; how many full collections the close ran; and the KV cache's size in tokens as
    vLLM counts it."""
    import gc

    class Cycle:
        def __init__(self, flag: list):
            self.me, self.flag = self, flag

        def __del__(self):
            self.flag.append("collected")

    def count(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            seen["full_collections_at_close"] += 1

    flag: list[str] = []
    seen = {"full_collections_at_close": 0}
    gc.disable()  # only the build's own collections (vLLM's gc.collect calls) may find it
    try:
        Cycle(flag)

        def use(engine):
            cache = engine.llm.llm_engine.vllm_config.cache_config
            seen["kv_tokens"] = cache.num_gpu_blocks * cache.block_size
            seen["old_garbage_during_build"] = flag[0] if flag else "alive"
            gc.callbacks.append(count)  # the close comes next

        host._on_fresh_engine("vllm", model_path, {"max_model_len": MAX_MODEL_LEN}, use)
        seen["old_garbage_after_close"] = flag[0] if flag else "alive"
    finally:
        gc.enable()
        if count in gc.callbacks:
            gc.callbacks.remove(count)
    return seen


# ---- the run's host as the flow starts it and the evaluations find it (tasks/stages/eval_engine.py) --------


def _plan_and_ctx(tmp_path, **evaluation):
    from alignflow.config import PipelineConfig
    from tasks.context import RunContext
    from tasks.plan import plan_pipeline

    cfg = PipelineConfig(infra={"storage": {"root": str(tmp_path / "artifacts")}}, evaluation=evaluation)
    return cfg, plan_pipeline(cfg), RunContext(infra=cfg.infra, parent_run_id=f"test-{tmp_path.name}")


def _named(name: str):
    from tasks.stages.eval_engine import NAMESPACE

    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def test_the_flows_host_serves_evaluations_ends_with_the_flow_and_a_lost_one_is_replaced(
        ray_local, tiny_model, prompts, tmp_path, caplog):
    import time

    from tasks.stages.eval_engine import OWN_ACTOR, RUN_HOST, engine_host, generate, host_name

    cfg, plan, ctx = _plan_and_ctx(tmp_path, generation={"backend": "hf"})
    g, kwargs = cfg.evaluation.generation, dict(seed=3, dtype="float32", max_model_len=MAX_MODEL_LEN,
                                                 attn_implementation="sdpa")
    with engine_host(plan, ctx) as hosted:
        assert hosted.engine_host == host_name(ctx) and _named(host_name(ctx)) is not None
        first, where = generate("eval_sft", g, hosted, str(tiny_model), prompts, SAMPLING, **kwargs)
        assert where == RUN_HOST
    deadline = time.monotonic() + 30
    while _named(host_name(ctx)) is not None:  # ray.kill is asynchronous
        assert time.monotonic() < deadline, "the run's engine host outlived the flow"
        time.sleep(0.2)
    with caplog.at_level("WARNING", logger="alignflow"):
        again, where = generate("eval_sft", g, hosted, str(tiny_model), prompts, SAMPLING, **kwargs)
    assert where == OWN_ACTOR
    assert f"eval_sft: the run's engine host {host_name(ctx)} is gone" in caplog.text
    assert _samples(again) == _samples(first)


def test_no_host_where_evaluations_keep_no_engine_or_none_will_compute(ray_local, tmp_path):
    from tasks.stages.eval_engine import engine_host, host_name

    _, plan, ctx = _plan_and_ctx(tmp_path, engine_lifetime="stage")
    with engine_host(plan, ctx) as same:
        assert same is ctx and _named(host_name(ctx)) is None

    _, plan, ctx = _plan_and_ctx(tmp_path)  # keeps its engine, but every evaluation is committed
    storage, done = ctx.storage(), tmp_path / "done"
    done.mkdir()
    (done / "metrics.json").write_text("{}")
    for stage in plan.of_kind("evaluate_policy"):
        storage.commit(done, storage.stage_uri(stage.name, stage.key), meta={"stage": stage.name})
    with engine_host(plan, ctx) as same:
        assert same is ctx and _named(host_name(ctx)) is None
