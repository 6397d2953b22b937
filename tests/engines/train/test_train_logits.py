"""Logits only where they are used (engines/train/logits.py), against the full-vocabulary computation.

The reference values come from the model's own full logits (every position, every
vocabulary entry) through `algos.sequence.shifted_logprobs` and `entropy_from_logits`,
computed here independently; values and parameter gradients must agree within fp32
rounding, with the output layer cut into many chunks as well as one.
"""

from __future__ import annotations

import pytest
import torch

from algos import entropy_from_logits
from algos.sequence import shifted_logprobs


@pytest.fixture(scope="module")
def model(tiny_model):
    from engines.models import load_policy

    torch.manual_seed(0)
    return load_policy(tiny_model).eval()


@pytest.fixture(scope="module")
def batch():
    """Two rollouts of different prompt and response lengths, right-padded as experience making pads them."""
    from engines.rl.experience import from_rollouts
    from engines.rollout.base import Rollout

    exp = from_rollouts([Rollout(0, [5, 6, 7, 8], [11, 12, 13, 40], "", [0.0] * 4, True),
                         Rollout(1, [9, 10], [14, 15], "", [0.0] * 2, True)], pad_id=0)
    return exp.tensors()


def full_reference(model, batch, temperature: float = 1.0):
    """(B, T) response logprobs and entropies from the full (B, L, V) logits, divided by `temperature`."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float() / temperature
    mask = batch["action_mask"]
    logprobs = torch.gather(shifted_logprobs(logits, batch["input_ids"]), 1, batch["response_index"]) * mask
    index = batch["response_index"].unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    entropy = entropy_from_logits(torch.gather(logits[:, :-1], 1, index)) * mask
    return logprobs, entropy


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("chunk_elements", [2**22, 3 * 320])  # one chunk; chunks of 3 positions
@pytest.mark.parametrize("keep_elements", [2**24, 0])  # logits kept for backward; every chunk recomputed
@pytest.mark.parametrize("temperature", [1.0, 0.6])  # the sampler's: π at logits / T
def test_response_logprobs_and_grads_match_full_logits(model, batch, chunk_elements, keep_elements, temperature,
                                                       monkeypatch):
    from torch.utils.checkpoint import checkpoint

    from engines.train import logits as logits_mod

    monkeypatch.setattr(logits_mod, "CHUNK_ELEMENTS", chunk_elements)
    monkeypatch.setattr(logits_mod, "KEEP_ELEMENTS", keep_elements)
    recomputed = []
    monkeypatch.setattr(logits_mod, "checkpoint", lambda *a, **k: recomputed.append(1) or checkpoint(*a, **k))
    weights = torch.randn(batch["action_mask"].shape, generator=torch.Generator().manual_seed(1))

    expected_lp, expected_h = full_reference(model, batch, temperature)
    ((expected_lp * weights).sum() + expected_h.sum()).backward()
    expected_grads = _grads(model)

    lp, h = logits_mod.response_logprobs_and_entropy(model, batch, with_entropy=True, temperature=temperature)
    ((lp * weights).sum() + h.sum()).backward()
    grads = _grads(model)

    torch.testing.assert_close(lp, expected_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, expected_h, rtol=1e-5, atol=1e-5)
    assert lp[1, 2:].abs().sum() == 0 and h[1, 2:].abs().sum() == 0  # padding stays 0
    assert bool(recomputed) == (keep_elements == 0)
    assert expected_grads.keys() == grads.keys()
    for name, g in expected_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_sft_logprobs_match_full_logits(model, batch):
    from engines.train.logits import masked_next_token_logprobs

    loss_mask = torch.zeros_like(batch["input_ids"])
    loss_mask[0, 5:8] = 1
    loss_mask[1, 2:4] = 1
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        expected = shifted_logprobs(logits, batch["input_ids"]) * loss_mask[:, 1:]
        got = masked_next_token_logprobs(model, batch, loss_mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_output_layer_never_sees_every_position(model, batch):
    """The output layer runs on one position per row (the model's own forward) and on the
    response tokens, never on the (B, L) grid."""
    from engines.train.logits import response_logprobs_and_entropy

    seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, inp, out: seen.append(tuple(inp[0].shape)))
    try:
        with torch.no_grad():
            response_logprobs_and_entropy(model, batch)
    finally:
        hook.remove()
    B, L = batch["input_ids"].shape
    n = int(batch["action_mask"].sum())
    hidden = model.config.hidden_size
    assert seen == [(B, 1, hidden), (n, hidden)]


def test_on_policy_objective_equals_the_one_given_old_logprobs(model, batch):
    """One optimizer step per batch: the policy loss with old = this forward's detached logprobs
    equals the loss given those logprobs from a separate forward, in value and gradient."""
    from engines.train.objectives import policy_objective, response_logprobs

    with torch.no_grad():
        old = response_logprobs(model, batch)
    adv = torch.randn(batch["action_mask"].shape, generator=torch.Generator().manual_seed(2)) * batch["action_mask"]
    common = dict(clip_low=0.2, clip_high=0.28, dual_clip=None, agg="token_mean", entropy_coef=0.01,
                  kl_loss_coef=0.04, kl_estimator="k3", kl_clamp=10.0, tis_cap=2.0)
    full = {**batch, "advantages": adv, "ref_logprobs": old - 0.1 * batch["action_mask"],
            "rollout_logprobs": old - 0.05 * batch["action_mask"]}
    given_loss, given = policy_objective(model, {**full, "old_logprobs": old}, **common)
    given_loss.backward()
    given_grads = _grads(model)
    own_loss, own = policy_objective(model, full, on_policy=True, **common)
    own_loss.backward()
    own_grads = _grads(model)

    assert own_loss.item() == pytest.approx(given_loss.item(), rel=1e-5)
    total, rows = own["sequence_kl"]  # (sum over rows, rows): a row mean the trainer combines exactly
    assert (total / rows, rows) == (pytest.approx(0.1 * float(batch["action_mask"].sum()) / 2, rel=1e-4), 2)
    for name, g in given_grads.items():
        torch.testing.assert_close(own_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_objective(model, full, **common)


def test_a_micro_batch_without_a_wanted_token_gives_a_zero_loss_with_a_gradient(model, batch):
    """No response (or loss) token in a micro-batch: log-probs (B, T) of zeros that still hang from the
    output layer, so the loss backpropagates zeros instead of failing ("does not require grad")."""
    import functools

    from engines.train import objectives

    empty = {**batch, "action_mask": torch.zeros_like(batch["action_mask"]),
             "advantages": torch.zeros(batch["action_mask"].shape)}
    policy = functools.partial(objectives.policy_objective, clip_low=0.2, clip_high=0.2, dual_clip=None,
                               agg="token_mean", entropy_coef=0.01, kl_loss_coef=0.0, kl_estimator="k3",
                               kl_clamp=None, tis_cap=None, on_policy=True)
    sft = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
           "loss_mask": torch.zeros_like(batch["input_ids"])}
    for objective, rows in ((policy, empty), (objectives.causal_lm_objective, sft)):
        model.zero_grad(set_to_none=True)
        loss, _ = objective(model, rows)
        assert loss.item() == 0.0
        loss.backward()
        head = model.get_output_embeddings().weight.grad
        assert head is not None and not head.any()
    model.zero_grad(set_to_none=True)


def test_a_policy_micro_batch_waits_for_the_device_once_beyond_the_model(tiny_model):
    """What bench/step/launches.py counts, held: the policy objective's training pass on a GPU's path (no shared
    prompt) makes the host wait for the device once more than the textbook pass (the response positions'
    nonzero: logits only there); its metrics stay on the device until the step's end (engines/batches.py
    host_metrics). Counted by the torch profiler."""
    import argparse
    import sys
    from pathlib import Path

    from engines.models import load_policy

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "step"))  # launches.py imports measure.py beside it
    try:
        import launches

        model = load_policy(tiny_model).train()
        batch = launches.batch_of(model, argparse.Namespace(groups=2, samples=4, prompt_tokens=6, new_tokens=5), "cpu")
        (_, ours), (_, plain) = (launches.counts(fn, model, batch, False, 1)
                                 for fn in (launches.alignflow_gpu_path, launches.plain_step))
    finally:
        sys.path.pop(0)
    assert plain >= 1 and ours == plain + 1, (ours, plain)


def _tiny_family(family: str):
    """A randomly initialised causal LM of a family whose forward changes the logits after the output layer."""
    import transformers

    common = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64)
    config, cls = {
        "granite": (transformers.GraniteConfig(logits_scaling=8.0, **common), transformers.GraniteForCausalLM),
        "cohere": (transformers.CohereConfig(logit_scale=0.25, **common), transformers.CohereForCausalLM),
        "gemma2": (transformers.Gemma2Config(final_logit_softcapping=3.0, head_dim=16, **common),
                   transformers.Gemma2ForCausalLM),
    }[family]
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # logits large enough that the softcap bites
        model.get_output_embeddings().weight.mul_(20.0)
    return model


@pytest.mark.parametrize("family", ["granite", "cohere", "gemma2"])
def test_log_probs_follow_what_the_model_does_to_its_logits_after_the_output_layer(family, batch):
    """Granite divides the logits by logits_scaling, Cohere multiplies them by logit_scale and Gemma 2/3 softcap
    them (c · tanh(z / c)): the log-probs from hidden states are those of the model's own logits, which vLLM
    samples from."""
    from engines.train import logits as logits_mod

    model = _tiny_family(family)
    with torch.no_grad():
        expected, _ = full_reference(model, batch, 0.8)
        got, _ = logits_mod.response_logprobs_and_entropy(model, batch, temperature=0.8)
        # The output layer alone (what was computed before) is another distribution: the test can tell.
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        bare = model.get_output_embeddings()(logits_mod.final_hidden(model, batch)).float()
        own = model(**inputs).logits.float()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (torch.log_softmax(bare, -1) - torch.log_softmax(own, -1)).abs().max() > 1e-2


def test_a_scoring_forward_keeps_no_kv_cache(model, batch):
    """A model's config asks for a KV cache by default (use_cache), which nothing here reads: under no_grad
    (reference, old log-probs) it would be memory held beside the hidden states for the whole forward."""
    from engines.train import logits as logits_mod

    assert model.config.use_cache  # the default the forward must override
    caches = []
    handle = model.register_forward_hook(lambda m, args, kwargs, out: caches.append(out.past_key_values),
                                         with_kwargs=True)
    try:
        with torch.no_grad():
            logits_mod.final_hidden(model, batch)
    finally:
        handle.remove()
    assert caches == [None]


def _live_layer_outputs_at_the_final_norm(model, run) -> int:
    """How many decoder layers' outputs are still alive when the final norm runs inside `run()`."""
    import weakref

    refs, live = [], []
    hooks = [layer.register_forward_hook(
        lambda m, args, out: refs.append(weakref.ref(out[0] if isinstance(out, tuple) else out)))
        for layer in model.model.layers]
    hooks.append(model.model.norm.register_forward_pre_hook(
        lambda m, args: live.append(sum(r() is not None for r in refs))))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    return live[0]


def test_a_scoring_forward_keeps_one_layer_of_hidden_states_alive(model, batch):
    """Under no_grad each layer's output is garbage once the next layer has read it. Asking the model for its
    hidden states (output_hidden_states) would keep all of them to the end of the forward: the reference
    and old log-probs' memory times the layer count."""
    from engines.train import logits as logits_mod

    layers = len(model.model.layers)
    assert layers >= 2  # else the two ways keep the same
    recorded = _live_layer_outputs_at_the_final_norm(model, lambda: model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True))
    assert recorded == layers  # what the old way kept: every layer's output
    hidden = []
    assert _live_layer_outputs_at_the_final_norm(model, lambda: hidden.append(logits_mod.final_hidden(model, batch))) == 1
    expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(hidden[0], expected)
