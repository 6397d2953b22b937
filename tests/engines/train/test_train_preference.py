"""The preference stage's rows and objectives (engines/train/preference.py) against sums and formulas done by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engines.train.preference import (dpo_objective, kto_objective, preference_tensors, reference_free_objective,
                                      sequence_logps)

RECORDS = [
    {"prompt": "Which digit is largest? 1 5 3", "chosen": "5", "rejected": "1"},
    {"prompt": "Which digit is largest? 7 2", "chosen": "7", "rejected": "2 2"},
    {"prompt": [{"role": "user", "content": "Which digit is largest? 4 9 8 6"}], "chosen": "9", "rejected": "4"},
]


@pytest.fixture(scope="module")
def policy(tiny_model):
    from engines.models import load_policy

    return load_policy(str(tiny_model), "float32", "eager").eval()


def _ids(tokenizer, prompt) -> list[int]:
    from engines.batches import render_prompt

    return render_prompt(tokenizer, prompt)


def _reply(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def test_rows_pair_each_prompt_with_its_replies_and_the_next_pairs_for_kl(tokenizer):
    rows = preference_tensors(tokenizer, RECORDS, max_prompt_tokens=64, max_response_tokens=8)
    main, kl, report = rows.main, rows.kl, rows.reports["preference"]
    assert report.total == 3 and report.overlong == 0 and rows.pairs == 3
    assert rows.desirable.tolist() == [True] * 3 + [False] * 3
    assert main["input_ids"].shape[0] == kl["input_ids"].shape[0] == 6
    for i, (side, k, reply_k) in enumerate([(s, k, r) for s in ("chosen", "rejected") for k, r in
                                            ((0, 0), (1, 1), (2, 2))]):
        prompt = _ids(tokenizer, RECORDS[k]["prompt"])
        for rows, reply_from in ((main, reply_k), (kl, (k + 1) % 3)):
            reply = _reply(tokenizer, RECORDS[reply_from][side])
            n = int(rows["attention_mask"][i].sum())
            assert rows["input_ids"][i, :n].tolist() == prompt + reply
            assert rows["loss_mask"][i, :n].tolist() == [0] * len(prompt) + [1] * len(reply)
            assert rows["loss_mask"][i, n:].sum() == 0


UNPAIRED = [
    {"prompt": "Which digit is largest? 3 8", "response": "8", "label": True},
    {"prompt": "Which digit is largest? 6 1 0", "response": "1", "label": False},
]


def test_unpaired_examples_follow_the_pairs_with_their_labels(tokenizer):
    rows = preference_tensors(tokenizer, RECORDS[:2], 64, 8, unpaired=UNPAIRED)
    assert rows.pairs == 2 and rows.main["input_ids"].shape[0] == rows.kl["input_ids"].shape[0] == 6
    assert rows.desirable.tolist() == [True, True, False, False, True, False]
    for i, (k, reply_from) in enumerate(((0, 0), (1, 1))):
        prompt = _ids(tokenizer, UNPAIRED[k]["prompt"])
        for batch, j in ((rows.main, reply_from), (rows.kl, 1 - k)):
            n = int(batch["attention_mask"][4 + i].sum())
            assert batch["input_ids"][4 + i, :n].tolist() == prompt + _reply(tokenizer, UNPAIRED[j]["response"])
    assert set(rows.reports) == {"preference", "preference_unpaired"}


def test_an_overlong_prompt_is_left_out_and_counted(tokenizer):
    limit = len(_ids(tokenizer, RECORDS[1]["prompt"]))  # the shortest prompt fits, the others do not
    rows = preference_tensors(tokenizer, RECORDS, max_prompt_tokens=limit, max_response_tokens=8)
    assert rows.reports["preference"].overlong == 2 and rows.main["input_ids"].shape[0] == 2
    assert rows.metrics()["data/preference_overlong_prompts"] == 2


def _by_hand(policy, rows) -> torch.Tensor:
    """Σ log softmax over the response tokens, one sequence at a time, without padding."""
    out = []
    for ids, mask, lm in zip(rows["input_ids"], rows["attention_mask"], rows["loss_mask"]):
        n = int(mask.sum())
        logp = F.log_softmax(policy(input_ids=ids[None, :n]).logits[0].double(), -1)
        out.append(sum(logp[t - 1, ids[t]] for t in range(1, n) if lm[t]))
    return torch.stack(out)


def test_sequence_logps_sum_the_response_tokens(policy, tokenizer):
    main = preference_tensors(tokenizer, RECORDS, 64, 8).main
    with torch.no_grad():
        got = sequence_logps(policy, main)
        want = _by_hand(policy, main)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("loss_type,smoothing", [("sigmoid", 0.0), ("cdpo", 0.2), ("ipo", 0.0)])
def test_dpo_objective_matches_the_formula(policy, tokenizer, loss_type, smoothing):
    main = preference_tensors(tokenizer, RECORDS, 64, 8).main
    ref = torch.tensor([-3.0, -1.5, -2.0, -4.0, -0.5, -6.0])
    beta = 0.5
    with torch.no_grad():
        loss, metrics = dpo_objective(policy, {**main, "ref_logps": ref}, loss_type=loss_type, beta=beta,
                                      label_smoothing=smoothing)
        lp = _by_hand(policy, main).tolist()
    expected, margins, correct = [], [], 0
    for k in range(3):
        c, r = lp[k] - ref[k].item(), lp[k + 3] - ref[k + 3].item()
        h = c - r
        if loss_type == "ipo":
            expected.append((h - 1 / (2 * beta)) ** 2)
        else:
            sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
            expected.append(-(1 - smoothing) * math.log(sig(beta * h)) - smoothing * math.log(sig(-beta * h)))
        margins.append(beta * h)
        correct += beta * c > beta * r
    assert loss.item() == pytest.approx(sum(expected) / 3, abs=1e-4)
    assert metrics["reward_margin"] == pytest.approx(sum(margins) / 3, abs=1e-4)
    assert metrics["accuracy"] == pytest.approx(correct / 3)
    assert metrics["chosen_reward"] == pytest.approx(sum(beta * (lp[k] - ref[k].item()) for k in range(3)) / 3,
                                                     abs=1e-4)


def test_rpo_adds_the_chosen_responses_nll_per_token(policy, tokenizer):
    """rpo_alpha: the DPO loss plus alpha times the chosen responses' mean NLL per response token."""
    main = preference_tensors(tokenizer, RECORDS, 64, 8).main
    batch = {**main, "ref_logps": torch.tensor([-3.0, -1.5, -2.0, -4.0, -0.5, -6.0])}
    with torch.no_grad():
        plain, _ = dpo_objective(policy, batch, loss_type="sigmoid", beta=0.5, label_smoothing=0.0)
        rpo, metrics = dpo_objective(policy, batch, loss_type="sigmoid", beta=0.5, label_smoothing=0.0,
                                     rpo_alpha=0.25)
        lp = _by_hand(policy, main).tolist()
    tokens = [int(main["loss_mask"][k, 1:].sum()) for k in range(3)]
    nll = sum(-lp[k] / tokens[k] for k in range(3)) / 3
    assert rpo.item() == pytest.approx(plain.item() + 0.25 * nll, abs=1e-4)
    assert metrics["chosen_nll"] == pytest.approx(nll, abs=1e-4) and nll > 0


def test_rpo_on_an_online_rounds_rollout_rows_divides_by_each_chosen_responses_sampled_tokens(policy, tokenizer):
    """The RL layout (response_index, action_mask): two chosen rollouts of 3 and 1 tokens, two rejected."""
    from engines.rl.experience import from_rollouts
    from engines.rollout.base import Rollout

    prompt = _ids(tokenizer, RECORDS[0]["prompt"])
    replies = [_reply(tokenizer, t) for t in ("5 5", "5", "1", "1 1")]
    rollouts = [Rollout(0, prompt, ids, "", [0.0] * len(ids), True) for ids in replies]
    exp = from_rollouts(rollouts, tokenizer.pad_token_id)
    batch = {k: getattr(exp, k) for k in ("input_ids", "attention_mask", "response_index", "action_mask")}
    batch["ref_logps"] = torch.tensor([-3.0, -1.5, -2.0, -4.0])
    with torch.no_grad():
        plain, _ = dpo_objective(policy, batch, loss_type="sigmoid", beta=0.5, label_smoothing=0.0, rollouts=True)
        rpo, metrics = dpo_objective(policy, batch, loss_type="sigmoid", beta=0.5, label_smoothing=0.0,
                                     rollouts=True, rpo_alpha=2.0)
        nll = []
        for ids in replies[:2]:  # by hand: each chosen reply's mean NLL over its own tokens
            seq = torch.tensor([prompt + ids])
            logp = F.log_softmax(policy(input_ids=seq).logits[0].double(), -1)
            nll.append(-sum(logp[len(prompt) + t - 1, ids[t]] for t in range(len(ids))).item() / len(ids))
    assert len(replies[0]) != len(replies[1])
    assert rpo.item() == pytest.approx(plain.item() + 2.0 * sum(nll) / 2, abs=1e-4)
    assert metrics["chosen_nll"] == pytest.approx(sum(nll) / 2, abs=1e-4)


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_reference_free_objectives_take_each_responses_mean_token_log_prob(policy, tokenizer, loss):
    """SimPO and ORPO by hand: each response's summed log-probability over its own token count (reply + EOS), no
    reference; packed rows give the same loss."""
    main = preference_tensors(tokenizer, RECORDS, 64, 8).main
    beta, gamma = 2.0, 0.7
    with torch.no_grad():
        loss_value, metrics = reference_free_objective(policy, main, loss=loss, beta=beta, gamma=gamma)
        packed, _ = reference_free_objective(policy, main, loss=loss, beta=beta, gamma=gamma, packing_max_tokens=None)
        lp = _by_hand(policy, main).tolist()
    replies = [r[side] for side in ("chosen", "rejected") for r in RECORDS]
    avg = [s / len(_reply(tokenizer, text)) for s, text in zip(lp, replies)]
    log_sig = lambda x: -math.log1p(math.exp(-x))  # noqa: E731
    odds = lambda a: a - math.log(1 - math.exp(a))  # noqa: E731
    if loss == "simpo":
        per = [-log_sig(beta * (avg[k] - avg[k + 3]) - gamma) for k in range(3)]
    else:
        per = [-avg[k] - beta * log_sig(odds(avg[k]) - odds(avg[k + 3])) for k in range(3)]
    assert loss_value.item() == pytest.approx(sum(per) / 3, abs=1e-4)
    assert packed.item() == pytest.approx(loss_value.item(), abs=1e-5)
    assert metrics["chosen_reward"] == pytest.approx(beta * sum(avg[:3]) / 3, abs=1e-4)
    assert metrics["accuracy"] == pytest.approx(sum(avg[k] > avg[k + 3] for k in range(3)) / 3)
    with pytest.raises(ValueError, match="simpo, orpo"):
        reference_free_objective(policy, main, loss="dpo", beta=beta, gamma=gamma)


def test_kto_objective_takes_its_reference_point_from_the_mismatched_rows(policy, tokenizer):
    rows = preference_tensors(tokenizer, RECORDS, 64, 8)
    main, kl = rows.main, rows.kl
    ref = torch.tensor([-3.0, -1.5, -2.0, -4.0, -0.5, -6.0])
    ref_kl = torch.tensor([-40.0, -38.0, -37.0, -39.5, -38.5, -37.5])  # far below: z0 > 0
    desirable = torch.tensor([True, True, True, False, False, False])
    batch = {**main, **{f"kl_{k}": v for k, v in kl.items()}, "ref_logps": ref, "ref_kl_logps": ref_kl,
             "desirable": desirable}
    beta, wd, wu = 0.3, 1.0, 1.5
    with torch.no_grad():
        loss, metrics = kto_objective(policy, batch, beta=beta, desirable_weight=wd, undesirable_weight=wu)
        lp, lp_kl = _by_hand(policy, main).tolist(), _by_hand(policy, kl).tolist()
    z0 = max(0.0, sum(a - b for a, b in zip(lp_kl, ref_kl.tolist())) / 6)
    assert z0 > 0
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    per = [wd * (1 - sig(beta * (lp[i] - ref[i].item() - z0))) if desirable[i] else
           wu * (1 - sig(beta * (z0 - lp[i] + ref[i].item()))) for i in range(6)]
    assert metrics["kl_reference_point"] == pytest.approx(z0, abs=1e-4)
    assert loss.item() == pytest.approx(sum(per) / 6, abs=1e-4)


def test_packed_rows_give_the_unpacked_losses(policy, tokenizer):
    """preference.packing: each batch packed into shared rows with a block mask gives the same DPO and KTO
    losses (the sums run over ~10 tokens of log-probabilities near -8: 1e-5 is float32's reach)."""
    rows = preference_tensors(tokenizer, RECORDS, 64, 8)
    main, kl = rows.main, rows.kl
    ref = torch.tensor([-3.0, -1.5, -2.0, -4.0, -0.5, -6.0])
    batch = {**main, **{f"kl_{k}": v for k, v in kl.items()}, "ref_logps": ref, "ref_kl_logps": ref - 30,
             "desirable": torch.tensor([True] * 3 + [False] * 3)}
    with torch.no_grad():
        for fn, kw in ((dpo_objective, dict(loss_type="sigmoid", beta=0.5, label_smoothing=0.0)),
                       (kto_objective, dict(beta=0.3, desirable_weight=1.0, undesirable_weight=1.5))):
            plain, _ = fn(policy, batch, **kw)
            for width in (None, 2 * main["input_ids"].shape[1]):
                packed, _ = fn(policy, batch, packing_max_tokens=width, **kw)
                assert packed.item() == pytest.approx(plain.item(), abs=1e-5), (fn.__name__, width)


def test_kto_objective_prepared_over_micro_batches_gives_the_whole_batchs_loss(policy, tokenizer):
    """KTOObjective.prepare takes z0 over every micro-batch; each micro-batch's loss against it, weighed by
    rows, adds up to the whole batch's loss. Against its own z0 (one row's), a micro-batch's loss differs."""
    from engines.micro_batching import micro_batches
    from engines.train.preference import KTOObjective

    rows = preference_tensors(tokenizer, RECORDS, 64, 8)
    with torch.no_grad():  # implicit rewards of 1-4 nats; z0 = 2.75, by pairs of rows 2.25, 3.5 and 2.5
        ref = _by_hand(policy, rows.main) - torch.tensor([2.0, 3.0, 1.0, 4.0, 2.5, 3.5])
        ref_kl = _by_hand(policy, rows.kl) - torch.tensor([0.5, 4.0, 1.0, 6.0, 2.0, 3.0])
    batch = {**rows.main, **{f"kl_{k}": v for k, v in rows.kl.items()}, "ref_kl_logps": ref_kl,
             "ref_logps": ref, "desirable": rows.desirable}
    objective = KTOObjective(beta=1.0, desirable_weight=1.0, undesirable_weight=1.5)
    with torch.no_grad():
        whole, m_whole = objective(policy, batch)
        micro = micro_batches(batch, 2)
        shared = objective.prepare(policy, micro, "cpu")
        assert shared["z0"].item() == pytest.approx(float(m_whole["kl_reference_point"]), rel=1e-6)
        assert shared["z0"].item() == pytest.approx(2.75, abs=1e-5)
        parts = [objective(policy, m, **shared)[0].item() * 2 / 6 for m in micro]
        alone = [objective(policy, m)[0].item() * 2 / 6 for m in micro]
    assert sum(parts) == pytest.approx(whole.item(), abs=1e-6)
    assert abs(sum(alone) - whole.item()) > 1e-2



def test_kto_reward_metrics_are_the_steps_whatever_its_micro_batches(policy, tokenizer):
    """Micro-batches of one row hold one kind of example each: the step's chosen / rejected reward is
    still the mean implicit reward β(log π − log π_ref) over all its desirable / undesirable examples."""
    from engines.accumulate import add_metrics, combine_ranks, host_metrics
    from engines.micro_batching import micro_batches
    from engines.train.preference import KTOObjective

    rows = preference_tensors(tokenizer, RECORDS, 64, 8)
    implicit = torch.tensor([2.0, 3.0, 1.0, 4.0, 2.5, 3.5])
    with torch.no_grad():
        ref = _by_hand(policy, rows.main) - implicit
        ref_kl = _by_hand(policy, rows.kl)
    batch = {**rows.main, **{f"kl_{k}": v for k, v in rows.kl.items()}, "ref_kl_logps": ref_kl,
             "ref_logps": ref, "desirable": rows.desirable}
    beta = 0.5
    des = rows.desirable.bool()
    expected_chosen = beta * implicit[des].mean().item()
    expected_rejected = beta * implicit[~des].mean().item()
    objective = KTOObjective(beta=beta, desirable_weight=1.0, undesirable_weight=1.0)
    for size in (1, 2, 6):
        sums: dict = {}
        with torch.no_grad():
            micro = micro_batches(batch, size)
            shared = objective.prepare(policy, micro, "cpu")
            for m in micro:
                add_metrics(sums, objective(policy, m, **shared)[1], m["input_ids"].shape[0] / 6)
        step = objective.summarize(combine_ranks([host_metrics(sums)]))
        assert step["chosen_reward"] == pytest.approx(expected_chosen, abs=1e-4), size
        assert step["rejected_reward"] == pytest.approx(expected_rejected, abs=1e-4), size
        assert step["reward_margin"] == pytest.approx(expected_chosen - expected_rejected, abs=1e-4), size


def test_kl_rows_take_a_response_to_another_prompt(tokenizer):
    """KTO's z0 is the KL on completions of *other* prompts. Unpaired rows made from pairs, and HH's several
    pairs per prompt, sit side by side: the next row (the old choice) answered the row's own prompt."""
    from engines.train.preference import mismatched

    assert mismatched([[1], [1], [2], [2], [3]]) == [2, 2, 4, 4, 0]
    assert mismatched([[1], [2], [1]]) == [1, 2, 1]  # the first row of another prompt, wrapping
    assert mismatched([[5], [5], [5]]) == [1, 2, 0] and mismatched([[5]]) == [0]  # one prompt: the next row

    unpaired = [{"prompt": p, "response": r, "label": good} for p, pair in
                (("Which digit is largest? 3 8", ("8", "3")), ("Which digit is largest? 6 1", ("6", "1")))
                for r, good in zip(pair, (True, False))]
    rows = preference_tensors(tokenizer, [], 64, 8, unpaired)
    for i, record in enumerate(unpaired):
        prompt, n = _ids(tokenizer, record["prompt"]), int(rows.kl["attention_mask"][i].sum())
        other = [r for r in unpaired if r["prompt"] != record["prompt"]]
        assert rows.kl["input_ids"][i, :n].tolist() in [prompt + _reply(tokenizer, r["response"]) for r in other]
    assert rows.kl_own_prompt == 0 and rows.metrics()["preference/kl_rows_own_prompt"] == 0

    one = preference_tensors(tokenizer, RECORDS[:1], 64, 8)  # a single pair: its own replies, counted
    assert one.kl_own_prompt == 2 and torch.equal(one.kl["input_ids"], one.main["input_ids"])
