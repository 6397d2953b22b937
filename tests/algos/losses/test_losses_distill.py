"""On-policy distillation's per-token signal against values worked out by hand."""

import math

import pytest
import torch

import algos


def test_the_signal_of_a_two_token_response_is_its_hand_computed_reverse_kl():
    # Student and teacher next-token distributions over a 3-token vocabulary, at two positions; the
    # student sampled token 0, then token 2.
    student = [[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]
    teacher = [[0.25, 0.5, 0.25], [0.2, 0.4, 0.4]]
    sampled = [0, 2]
    s_lp = torch.tensor([[math.log(student[t][y]) for t, y in enumerate(sampled)]])
    t_lp = torch.tensor([[math.log(teacher[t][y]) for t, y in enumerate(sampled)]])
    mask = torch.ones(1, 2)

    kl = algos.reverse_kl_per_token(s_lp, t_lp, mask)
    # log(0.5 / 0.25) = log 2 and log(0.8 / 0.4) = log 2: the student over-weights both of its tokens.
    assert kl[0].tolist() == pytest.approx([math.log(2.0), math.log(2.0)], abs=1e-6)
    rewards = algos.distillation_token_rewards(s_lp, t_lp, mask)
    assert rewards[0].tolist() == pytest.approx([-math.log(2.0), -math.log(2.0)], abs=1e-6)
    out = algos.get_advantage_estimator("per_token")(token_rewards=rewards, action_mask=mask, values=None,
                                                      group_size=1, gamma=1.0, lam=1.0, eps=1e-6)
    assert out.advantages[0].tolist() == pytest.approx(rewards[0].tolist())  # no return-to-go: token 0 keeps its own

    # Averaged over the student's own samples, the signal estimates each position's exact reverse KL.
    gen = torch.Generator().manual_seed(0)
    draws = torch.multinomial(torch.tensor(student), 200_000, replacement=True, generator=gen)  # (2, N)
    log_s, log_t = torch.tensor(student).log(), torch.tensor(teacher).log()
    s_all, t_all = log_s.gather(1, draws).T, log_t.gather(1, draws).T  # (N, 2): N sampled two-token responses
    mean_kl = algos.reverse_kl_per_token(s_all, t_all, torch.ones_like(s_all)).mean(0)
    exact = [sum(p * math.log(p / q) for p, q in zip(student[t], teacher[t])) for t in range(2)]
    assert mean_kl.tolist() == pytest.approx(exact, abs=5e-3)


def test_padding_gets_no_signal_and_a_teacher_that_prefers_the_token_rewards_it():
    s_lp = torch.tensor([[-2.0, -1.0, 5.0]])
    t_lp = torch.tensor([[-0.5, -3.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    rewards = algos.distillation_token_rewards(s_lp, t_lp, mask)
    assert rewards[0].tolist() == pytest.approx([1.5, -2.0, 0.0])
    assert not rewards.requires_grad


def test_shapes_must_agree():
    with pytest.raises(ValueError):
        algos.reverse_kl_per_token(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


def test_the_top_k_loss_is_the_kl_from_the_renormalised_teacher_worked_by_hand():
    # Teacher: top-2 tokens of probability 0.6 and 0.2 (renormalised: 0.75, 0.25). Student: 0.5 and 0.25.
    teacher = torch.tensor([[math.log(0.6), math.log(0.2)]])
    student = torch.tensor([[math.log(0.5), math.log(0.25)]])
    expected = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.25)
    assert algos.topk_forward_kl(student, teacher).tolist() == pytest.approx([expected])
    # A student that matches the renormalised top-k exactly has none left to learn, whatever the scale.
    assert algos.topk_forward_kl(torch.log(torch.tensor([[0.75, 0.25]])), teacher).item() == pytest.approx(0.0, abs=1e-7)
    # A student putting mass elsewhere pays for it even where its top-k ratio is right.
    assert algos.topk_forward_kl(torch.log(torch.tensor([[0.3, 0.1]])), teacher).item() == pytest.approx(math.log(2.5))


def test_the_top_k_loss_pulls_a_student_toward_the_teacher():
    teacher = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    logits = torch.zeros(1, 5, requires_grad=True)  # a uniform student over a vocabulary of 5
    top = torch.tensor([[0, 1, 2]])
    for _ in range(300):
        loss = algos.topk_forward_kl(torch.log_softmax(logits, -1).gather(-1, top), teacher).sum()
        loss.backward()
        with torch.no_grad():
            logits -= 0.5 * logits.grad
            logits.grad = None
    probs = torch.softmax(logits, -1)[0]
    assert probs[:3].tolist() == pytest.approx([0.7, 0.2, 0.1], abs=0.02) and probs[3:].sum() < 0.02
