"""The rollout engine in a Ray actor: vLLM (CPU build) sampling, logprobs and in-place weight sync; HF fallback."""

from __future__ import annotations

import functools

import math

import pytest
import ray
import torch

from alignflow.config import TinyModelConfig
from engines import models
from engines.rollout.actors import start_rollout_actor
from engines.rollout.base import Sampling
from engines.transport.sync import push_state
from engines.transport.wire import WeightSyncError

pytestmark = pytest.mark.engine

# vLLM's CPU backend caches prefixes in blocks of 128 tokens: a model with room
# for a longer prompt lets the tests see a stale prefix cache after a weight sync.
TINY = TinyModelConfig(max_position_embeddings=512)
MAX_MODEL_LEN = 320
SAMPLING = Sampling(n=2, temperature=1.0, top_p=1.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return models.build_tiny_model(TINY, seed=0, out_dir=tmp_path_factory.mktemp("rollout-policy"))


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """Same architecture and tokenizer, different weights."""
    return models.build_tiny_model(TINY, seed=1, out_dir=tmp_path_factory.mktemp("rollout-policy-seed1"))


@pytest.fixture(scope="module")
def tokenizer(policy):
    return models.load_tokenizer(policy)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    from engines.batches import render_prompt

    texts = ["Which digit is largest? 3 1 4 1 5", "Which digit is largest? 9 2", "hello",
             "Which digit is largest? " + "7 " * 100]
    ids = [render_prompt(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    assert 128 < len(ids[-1]) <= MAX_MODEL_LEN - SAMPLING.max_new_tokens  # over one cache block
    return ids


@functools.lru_cache(maxsize=4)
def _hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()


def _hf_logprobs(model_path, rollouts, temperature: float = 1.0) -> list[list[float]]:
    """Per-token logprobs of each rollout's tokens, recomputed with transformers in fp32 at `temperature`."""
    model = _hf_model(model_path)
    out = []
    with torch.no_grad():
        for r in rollouts:
            ids = torch.tensor([r.prompt_ids + r.token_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double() / temperature, -1)
            start = len(r.prompt_ids)
            out.append([logp[start - 1 + i, t].item() for i, t in enumerate(r.token_ids)])
    return out


def _max_diff(rollouts, reference) -> float:
    return max(abs(a - b) for r, ref in zip(rollouts, reference) for a, b in zip(r.logprobs, ref))


def _check_shapes(rollouts, prompts, sampling, eos_id):
    assert len(rollouts) == len(prompts) * sampling.n
    assert [r.prompt_index for r in rollouts] == [i for i in range(len(prompts)) for _ in range(sampling.n)]
    for r in rollouts:
        assert r.prompt_ids == prompts[r.prompt_index]
        assert 1 <= len(r.token_ids) <= sampling.max_new_tokens
        assert len(r.logprobs) == len(r.token_ids)
        assert all(lp <= 0.0 for lp in r.logprobs)
        if r.finished:
            assert r.token_ids[-1] == eos_id
        else:
            assert len(r.token_ids) == sampling.max_new_tokens


@pytest.fixture(scope="module")
def vllm_actor(ray_local, policy):
    actor = start_rollout_actor("vllm", str(policy), num_cpus=1, torch_threads=1, dtype="float32", seed=0,
                                max_model_len=MAX_MODEL_LEN)
    yield actor
    ray.kill(actor)


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_logprobs_are_of_the_distribution_sampled_at_the_temperature(backend, request, policy, prompts):
    """vLLM (logprobs_mode processed_logprobs) and HF (its scores after the temperature) report log-probs of
    logits / T, which the trainer's at T are compared with (TIS, async rounds, distillation)."""
    actor = request.getfixturevalue(f"{backend}_actor")
    sampling = Sampling(n=2, temperature=0.6, top_p=1.0, max_new_tokens=8)
    out = ray.get(actor.generate.remote(prompts, sampling))
    assert _max_diff(out, _hf_logprobs(policy, out, temperature=0.6)) <= 1e-4
    assert _max_diff(out, _hf_logprobs(policy, out)) > 0.05  # not the model's at temperature 1


def test_vllm_generate_and_weight_sync(vllm_actor, policy, other_model, prompts, tokenizer):
    before = ray.get(vllm_actor.generate.remote(prompts, SAMPLING))
    _check_shapes(before, prompts, SAMPLING, tokenizer.eos_token_id)
    # vLLM's sampled-token logprobs are those of the loaded model...
    assert _max_diff(before, _hf_logprobs(policy, before)) <= 1e-4
    # ...and clearly not those of the other model (else the sync check below proves nothing).
    assert _max_diff(before, _hf_logprobs(other_model, before)) > 0.1

    new_weights = models.load_policy(other_model).state_dict()
    # Small buckets: the update streams in many of them, each consumed as it arrives.
    assert push_state(new_weights, [vllm_actor], bucket_bytes=64 * 2**10) == sum(
        v.numel() * v.element_size() for v in new_weights.values())

    # The same prompts again: the long one's cached prefix must not survive the sync.
    after = ray.get(vllm_actor.generate.remote(prompts, SAMPLING))
    _check_shapes(after, prompts, SAMPLING, tokenizer.eos_token_id)
    assert _max_diff(after, _hf_logprobs(other_model, after)) <= 1e-4
    assert _max_diff(after, _hf_logprobs(policy, after)) > 0.1


def _vllm_own_texts(actor, prompts, sampling) -> list[tuple[list[int], str]]:
    """A generation in the actor's engine with vLLM's own incremental detokenizer on: (tokens, text)."""
    def run(self, prompts, sampling):
        from vllm import SamplingParams

        params = SamplingParams(n=sampling.n, temperature=sampling.temperature, max_tokens=sampling.max_new_tokens,
                                detokenize=True)
        outs = self.engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(list(c.token_ids), c.text) for o in outs for c in o.outputs]

    return ray.get(actor.__ray_call__.remote(run, prompts, sampling))


def test_vllm_texts_are_those_of_its_incremental_detokenizer(vllm_actor, prompts, tokenizer):
    """Rollouts carry token ids from vLLM and text decoded once at the end (engines/rollout/texts.py); on the
    same tokens that text is vLLM's own."""
    from engines.rollout.texts import response_texts

    sampling = Sampling(n=8, temperature=1.0, max_new_tokens=24)
    own = _vllm_own_texts(vllm_actor, prompts, sampling)
    pairs = [prompts[i // sampling.n] for i in range(len(own))]
    assert response_texts(tokenizer, pairs, [ids for ids, _ in own]) == [text for _, text in own]
    assert sum(len(text) for _, text in own) > 100

    out = ray.get(vllm_actor.generate.remote(prompts, sampling))
    assert [r.text for r in out] == response_texts(tokenizer, [r.prompt_ids for r in out],
                                                   [r.token_ids for r in out])
    whole = [tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in out]
    assert all(r.text == w for r, w in zip(out, whole) if not w.endswith("\ufffd"))


def _given_up_mid_sequence(self, prompts):
    """In the actor: two requests through an EngineLoop (as the agent endpoint serves them), the long one given
    up once the short one is answered; then another request."""
    import time

    from engines.rollout.endpoint import EngineLoop

    loop, unbounded = EngineLoop(self.engine), time.monotonic() + 120
    long = loop.submit(prompts[0], Sampling(max_new_tokens=200, ignore_eos=True))
    short = loop.submit(prompts[1], Sampling(max_new_tokens=4, ignore_eos=True))
    loop.run(short.done, unbounded)
    given_up = loop.cancel(long)
    loop.run(lambda: loop.counts["abandoned"] == 1, unbounded)
    left = (self.engine.busy(), self.engine.llm.llm_engine.has_unfinished_requests())
    after = loop.submit(prompts[2], Sampling(max_new_tokens=3, ignore_eos=True))
    loop.run(after.done, unbounded)
    loop.close()
    return given_up, long.cancelled(), len(short.result()[0]), left, len(after.result()[0]), dict(loop.counts)


def test_a_request_given_up_mid_sequence_leaves_vllm_at_once(vllm_actor, prompts):
    """The agent endpoint gives up a request whose client left (engines/rollout/endpoint.py): vLLM aborts it
    mid-sequence (200 tokens asked; given up once the request added beside it has made its 4), and serves the
    next request."""
    given_up, cancelled, short, left, after, counts = ray.get(
        vllm_actor.__ray_call__.remote(_given_up_mid_sequence, prompts))
    assert given_up and cancelled and short == 4 and after == 3
    assert left == (False, False), "the given-up request is still in vLLM"
    assert counts == {"answered": 2, "abandoned": 1}


def _weights_of(model_path) -> dict[str, torch.Tensor]:
    return models.load_policy(model_path).state_dict()


@pytest.mark.parametrize(
    "corrupt, detail",
    [
        (lambda w: {**w, "model.norm.weight": torch.ones(7)}, "shapes="),
        (lambda w: {**w, "model.layers.9.mlp.up_proj.weight": torch.ones(2, 2)}, "unknown="),
        (lambda w: {k: v for k, v in w.items() if k != "lm_head.weight"}, "missing="),
    ],
    ids=["wrong-shape", "unknown-name", "missing-name"],
)
def test_vllm_rejects_a_bad_update_and_keeps_generating(vllm_actor, policy, prompts, tokenizer, corrupt, detail):
    good = _weights_of(policy)
    push_state(good, [vllm_actor])
    with pytest.raises(WeightSyncError, match="rejected") as err:
        push_state(corrupt(good), [vllm_actor])
    assert detail in str(err.value)
    # Nothing of the bad update was applied: the engine still serves the good weights.
    out = ray.get(vllm_actor.generate.remote(prompts, SAMPLING))
    _check_shapes(out, prompts, SAMPLING, tokenizer.eos_token_id)
    assert _max_diff(out, _hf_logprobs(policy, out)) <= 1e-4


def test_a_sleeping_vllm_engine_refuses_work_until_woken(vllm_actor, policy, prompts, tokenizer):
    """On every machine, though on the CPU sleep frees nothing: a sleeping vLLM would otherwise take the request
    and wait forever on its paused scheduler. The round's order: weights woken, updated, then the KV cache."""
    ray.get(vllm_actor.sleep.remote())
    with pytest.raises(RuntimeError, match=r"generate while \['kv_cache', 'weights'\] sleep"):
        ray.get(vllm_actor.generate.remote(prompts, SAMPLING))
    with pytest.raises(RuntimeError, match="update weights while .* wake it first"):
        ray.get(vllm_actor.receive_weights.remote())  # refused before it would wait for a sender
    ray.get(vllm_actor.wake.remote(["weights"]))
    push_state(_weights_of(policy), [vllm_actor])  # weights awake: the KV cache need not be
    with pytest.raises(RuntimeError, match=r"generate while \['kv_cache'\] sleep"):
        ray.get(vllm_actor.generate.remote(prompts, SAMPLING))
    with pytest.raises(ValueError, match="unknown sleep tags"):
        ray.get(vllm_actor.wake.remote(["kv"]))
    ray.get(vllm_actor.wake.remote(["kv_cache"]))
    out = ray.get(vllm_actor.generate.remote(prompts, SAMPLING))
    _check_shapes(out, prompts, SAMPLING, tokenizer.eos_token_id)
    assert _max_diff(out, _hf_logprobs(policy, out)) <= 1e-4


@pytest.fixture(scope="module")
def hf_actor(ray_local, policy):
    actor = start_rollout_actor("hf", str(policy), num_cpus=1, torch_threads=1, dtype="float32", seed=0)
    yield actor
    ray.kill(actor)


HF_SAMPLING = Sampling(n=2, temperature=1.0, max_new_tokens=8)


def test_hf_backend_generates(hf_actor, prompts, tokenizer):
    out = ray.get(hf_actor.generate.remote(prompts, HF_SAMPLING))
    _check_shapes(out, prompts, HF_SAMPLING, tokenizer.eos_token_id)


def test_hf_backend_is_seeded_once_not_per_call(ray_local, policy, prompts):
    """Successive calls draw fresh samples (no reseeding inside the engine); an engine built
    with the same seed replays the same sequence of calls."""
    actors = [start_rollout_actor("hf", str(policy), num_cpus=1, torch_threads=1, seed=11) for _ in range(2)]
    try:
        runs = [[[r.token_ids for r in ray.get(a.generate.remote(prompts, HF_SAMPLING))] for _ in range(2)]
                for a in actors]
    finally:
        for a in actors:
            ray.kill(a)
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]


def test_hf_backend_logprobs_match_a_recompute(hf_actor, policy, prompts):
    out = ray.get(hf_actor.generate.remote(prompts, HF_SAMPLING))
    assert _max_diff(out, _hf_logprobs(policy, out)) <= 1e-4


def test_unknown_backend(ray_local, policy):
    actor = start_rollout_actor("tgi", str(policy), num_cpus=0)
    with pytest.raises(Exception, match="unknown rollout backend 'tgi'"):
        ray.get(actor.generate.remote([[1]], SAMPLING))


def test_a_partial_rollout_takes_an_update_published_mid_response_between_its_pieces(ray_local, policy, other_model,
                                                                                   prompts, tokenizer):
    """An update is published as an asynchronous round's trainer publishes it (`publish`, as
    WeightSender.send(background=True) calls it): announced on the transport's store, then sent from a thread
    once the engine counts itself in, with no receive call from the driver. A generation in pieces of 3 tokens
    takes it after its first piece, unasked: each response's first 3 tokens carry the first model's log-probs
    (version 0), the other 5 the other model's (version 1). The driver's receive call that follows finds the
    update taken; the text is the whole response's."""
    from engines.placement.rendezvous import reserve_address
    from engines.rollout.texts import response_texts
    from engines.transport.sync import publish
    from engines.transport.wire import TransportGroup, pack, plan_buckets

    actor = start_rollout_actor("vllm", str(policy), num_cpus=1, torch_threads=1, dtype="float32", seed=0,
                                max_model_len=MAX_MODEL_LEN)
    sampling = Sampling(n=2, temperature=1.0, max_new_tokens=8, ignore_eos=True)
    try:
        state = models.load_policy(other_model).state_dict()
        specs = [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()]
        ray.get(actor.prepare_weights.remote(specs, 64 * 2**10))
        address = reserve_address("127.0.0.1")
        joined = actor.join_transport.remote(address, 1, 2, "gloo")
        group = TransportGroup(address, 0, 2, "gloo")
        ray.get(joined)
        buckets = plan_buckets(specs, 64 * 2**10)
        sender, errors = publish(group, 1, buckets, {id(b): pack(b, state, "cpu", None) for b in buckets})
        out = ray.get(actor.generate.remote(prompts[:3], sampling, 3))
        sender.join(timeout=60)
        assert not sender.is_alive() and not errors, f"the published update was not taken: {errors}"
        ray.get(actor.receive_weights.remote(1))  # taken already: returns at once, nothing on the wire
        later = ray.get(actor.generate.remote(prompts[:1], sampling))
    finally:
        ray.kill(actor)
    _check_shapes(out, prompts[:3], sampling, tokenizer.eos_token_id)
    assert [r.token_versions for r in out] == [[0] * 3 + [1] * 5] * 6
    assert {r.policy_version for r in out} == {0} and {r.policy_version for r in later} == {1}
    first, second = _hf_logprobs(policy, out), _hf_logprobs(other_model, out)
    for r, a, b in zip(out, first, second):
        assert max(abs(x - y) for x, y in zip(r.logprobs[:3], a[:3])) <= 1e-4, (r.logprobs, a)
        assert max(abs(x - y) for x, y in zip(r.logprobs[3:], b[3:])) <= 1e-4, (r.logprobs, b)
    assert _max_diff(out, second) > 0.1  # the first piece's are not the second model's
    assert [r.text for r in out] == response_texts(tokenizer, [r.prompt_ids for r in out], [r.token_ids for r in out])


def test_hf_backend_ignores_the_checkpoints_sampling_settings_and_stops_at_each_of_its_eos_ids(ray_local, policy,
                                                                                           prompts, tmp_path):
    """A checkpoint's generation_config.json (an instruct model's repetition_penalty, its end-of-turn and
    <|endoftext|> ids): its EOS ids end a response, as in vLLM, and nothing else of it changes the samples or
    their log-probs."""
    import json
    import shutil

    greedy = Sampling(n=1, temperature=0.0, max_new_tokens=8, ignore_eos=True)
    plain = start_rollout_actor("hf", str(policy), num_cpus=1, torch_threads=1, seed=0)
    try:
        first = ray.get(plain.generate.remote(prompts[:1], greedy))[0].token_ids[0]
    finally:
        ray.kill(plain)
    custom = tmp_path / "custom"
    shutil.copytree(policy, custom)
    (custom / "generation_config.json").write_text(json.dumps({"repetition_penalty": 3.0, "top_k": 2,
                                                                 "eos_token_id": [first]}))
    actor = start_rollout_actor("hf", str(custom), num_cpus=1, torch_threads=1, seed=0)
    try:
        (stopped,) = ray.get(actor.generate.remote(prompts[:1], Sampling(n=1, temperature=0.0, max_new_tokens=8)))
        sampled = ray.get(actor.generate.remote(prompts, Sampling(n=2, temperature=0.7, max_new_tokens=8)))
    finally:
        ray.kill(actor)
    assert (stopped.token_ids, stopped.finished) == ([first], True)
    assert _max_diff(sampled, _hf_logprobs(policy, sampled, temperature=0.7)) <= 1e-4


def test_a_gpu_engines_own_ray_workers_compile_too(ray_local):
    """A tensor-parallel vLLM engine runs its model in Ray actors it starts itself: they inherit the engine
    actor's runtime environment, not the os.environ its process edited (prepare_engine_process). A GPU engine's
    actor options turn TORCH_COMPILE_DISABLE, which every process of a run gets, off for those workers too."""
    import os

    from engines.rollout.vllm_engine import compiling_env

    @ray.remote(num_cpus=0)
    class Worker:
        def env(self):
            return os.environ.get("TORCH_COMPILE_DISABLE")

    @ray.remote(num_cpus=0)
    class Engine:
        def worker_env(self):
            os.environ.pop("TORCH_COMPILE_DISABLE", None)  # as prepare_engine_process does on a GPU
            return ray.get(Worker.remote().env.remote())

    cpu, gpu = (Engine.options(**compiling_env(on_gpu)).remote() for on_gpu in (False, True))
    assert ray.get([cpu.worker_env.remote(), gpu.worker_env.remote()]) == ["1", "0"]


def test_a_prefix_cache_vllm_keeps_after_an_update_is_an_error():
    """vLLM declines to reset its prefix cache (returns False) while a running request holds blocks: those
    blocks, computed with the old weights, would serve later prompts. The update raises instead of going on.
    (A request running through an update is what every caller prevents; a stand-in for vLLM shows the guard.)"""
    from engines.rollout.vllm_engine import VLLMEngine

    class Declining:
        def __init__(self, ok: bool):
            self.ok, self.calls = ok, []

        def collective_rpc(self, method, args=()):
            self.calls.append(method)

        def reset_prefix_cache(self):
            self.calls.append("reset")
            return self.ok

    for ok in (True, False):
        engine = VLLMEngine.__new__(VLLMEngine)
        engine.llm, engine._plan = Declining(ok), ([], 1)
        if ok:
            engine.receive_weights()
        else:
            with pytest.raises(RuntimeError, match="vLLM kept its prefix cache after a weight update"):
                engine.receive_weights()
        assert engine.llm.calls == ["alignflow_receive", "reset"]


def _top_p_logprobs(model_path, rollouts, temperature: float, top_p: float) -> list[list[float]]:
    """Per-token log-probs of the distribution each token was drawn from, recomputed: logits / T, the smallest
    set of most likely tokens whose probability reaches top_p kept, renormalised (Holtzman et al. 2020)."""
    model = _hf_model(model_path)
    out = []
    with torch.no_grad():
        for r in rollouts:
            logits = model(input_ids=torch.tensor([r.prompt_ids + r.token_ids])).logits[0].double() / temperature
            row = []
            for i, t in enumerate(r.token_ids):
                probs = torch.softmax(logits[len(r.prompt_ids) - 1 + i], -1)
                order = torch.argsort(probs, descending=True)
                before = torch.cumsum(probs[order], 0) - probs[order]  # mass of the more likely tokens
                kept = order[before < top_p]
                row.append(math.log(probs[t].item() / probs[kept].sum().item()) if t in kept.tolist() else -math.inf)
            out.append(row)
    return out


def test_hf_logprobs_are_taken_step_by_step_after_temperature_and_top_p(policy, prompts):
    """The HF engine keeps one step's log-softmax at a time (not every step's scores: 40 GB at 512 x 128 tokens
    over a 152k vocabulary) and takes it after its own temperature and top_p, as vLLM's processed_logprobs."""
    from engines.rollout.hf_engine import HFEngine, PickedLogprobs

    engine = HFEngine(str(policy), seed=3)
    for sampling in (Sampling(n=2, temperature=0.7, top_p=0.8, max_new_tokens=8),
                     Sampling(n=1, temperature=0.0, max_new_tokens=8)):
        out = engine.generate(prompts[:3], sampling)
        reference = (_top_p_logprobs(policy, out, sampling.temperature, sampling.top_p) if sampling.temperature
                     else _hf_logprobs(policy, out))
        assert _max_diff(out, reference) <= 1e-4, sampling
    picked = PickedLogprobs()  # generate undid a step it ran: the log-probs of the tokens it kept
    for seen in ([5], [5, 1], [5, 1, 0]):  # three steps run: tokens 1, 0 and one more drawn, then undone
        picked(torch.tensor([seen]), torch.log(torch.tensor([[0.25, 0.75]])))
    assert picked.of(torch.tensor([[1, 0]])).tolist()[0] == pytest.approx([math.log(0.75), math.log(0.25)])
