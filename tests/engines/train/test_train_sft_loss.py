"""Token logprobs, the SFT losses (NLL, DFT) and NEFTune's noise against plain-Python arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from algos.sequence import dft_loss, neftune_noise, shifted_logprobs, sft_loss, token_logprobs

# (B=2, L=4, V=3) logits, hand-written; one row has large values to exercise stability.
LOGITS = [
    [[1.0, 2.0, 0.5], [0.0, -1.0, 3.0], [2.0, 2.0, 2.0], [-0.5, 0.25, 1.5]],
    [[100.0, 98.0, 101.0], [-3.0, 0.0, 1.0], [0.1, 0.2, 0.3], [5.0, -5.0, 0.0]],
]
INPUT_IDS = [[2, 1, 0, 2], [1, 2, 2, 0]]


def _logp(row: list[float], label: int, temperature: float = 1.0) -> float:
    scaled = [x / temperature for x in row]
    m = max(scaled)
    lse = m + math.log(sum(math.exp(x - m) for x in scaled))
    return scaled[label] - lse


def test_token_logprobs_by_hand():
    labels = [[0, 2, 1, 1], [2, 0, 1, 0]]
    out = token_logprobs(torch.tensor(LOGITS), torch.tensor(labels))
    assert out.shape == (2, 4) and out.dtype == torch.float32
    expected = [[_logp(LOGITS[b][t], labels[b][t]) for t in range(4)] for b in range(2)]
    for b in range(2):
        assert out[b].tolist() == pytest.approx(expected[b], abs=1e-5)
    assert out[0, 2].item() == pytest.approx(-math.log(3), abs=1e-6)  # uniform row


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_token_logprobs_temperature(temperature):
    labels = [[1, 1, 1, 1], [0, 0, 0, 0]]
    out = token_logprobs(torch.tensor(LOGITS), torch.tensor(labels), temperature=temperature)
    for b in range(2):
        expected = [_logp(LOGITS[b][t], labels[b][t], temperature) for t in range(4)]
        assert out[b].tolist() == pytest.approx(expected, abs=1e-5)


def test_low_precision_logits_are_computed_in_float32():
    logits = torch.tensor(LOGITS, dtype=torch.bfloat16)
    out = token_logprobs(logits, torch.tensor(INPUT_IDS))
    assert out.dtype == torch.float32
    rounded = logits.float().tolist()
    for b in range(2):
        expected = [_logp(rounded[b][t], INPUT_IDS[b][t]) for t in range(4)]
        assert out[b].tolist() == pytest.approx(expected, abs=1e-5)


def test_shifted_logprobs_predicts_the_next_token():
    out = shifted_logprobs(torch.tensor(LOGITS), torch.tensor(INPUT_IDS))
    assert out.shape == (2, 3)
    for b in range(2):
        # Position t's logits predict input_ids[t + 1].
        expected = [_logp(LOGITS[b][t], INPUT_IDS[b][t + 1]) for t in range(3)]
        assert out[b].tolist() == pytest.approx(expected, abs=1e-5)


def _loss_by_hand(logits, ids, mask) -> float:
    total, count = 0.0, 0
    for b in range(len(ids)):
        for t in range(len(ids[b]) - 1):
            if mask[b][t + 1]:
                total -= _logp(logits[b][t], ids[b][t + 1])
                count += 1
    return total / count


def test_sft_loss_averages_over_response_tokens_of_the_batch():
    # loss_mask is over input_ids (1 on response tokens); row 1 has one response token.
    loss_mask = [[0, 1, 1, 1], [0, 0, 1, 0]]
    logprobs = shifted_logprobs(torch.tensor(LOGITS), torch.tensor(INPUT_IDS))
    loss = sft_loss(logprobs, torch.tensor(loss_mask)[:, 1:])
    assert loss.shape == ()
    # Token-weighted over the batch (4 tokens), not a mean of per-row means.
    assert loss.item() == pytest.approx(_loss_by_hand(LOGITS, INPUT_IDS, loss_mask), abs=1e-5)
    row_means = [_loss_by_hand([LOGITS[b]], [INPUT_IDS[b]], [loss_mask[b]]) for b in range(2)]
    assert abs(loss.item() - sum(row_means) / 2) > 1e-3


def test_padding_garbage_does_not_change_the_loss():
    loss_mask = [[0, 1, 1, 0], [0, 0, 1, 1]]
    clean = sft_loss(shifted_logprobs(torch.tensor(LOGITS), torch.tensor(INPUT_IDS)), torch.tensor(loss_mask)[:, 1:])
    # Garbage (huge but finite logits, other token ids) wherever the mask is 0.
    logits = torch.tensor(LOGITS)
    ids = torch.tensor(INPUT_IDS)
    logits[0, 2:] = torch.tensor([[1e4, -1e4, 7.0], [-3e3, 0.0, 5e3]])  # predict padding / nothing
    ids[0, 3] = 1  # padding
    logits[1, 0] = torch.tensor([-1e4, 2e4, 0.0])  # predicts a prompt token
    ids[1, 1] = 0  # prompt
    noisy = sft_loss(shifted_logprobs(logits, ids), torch.tensor(loss_mask)[:, 1:])
    assert torch.isfinite(noisy)
    assert noisy.item() == pytest.approx(clean.item(), abs=1e-6)
    assert clean.item() == pytest.approx(_loss_by_hand(LOGITS, INPUT_IDS, loss_mask), abs=1e-5)


def test_all_masked_gives_zero_not_nan():
    logprobs = shifted_logprobs(torch.tensor(LOGITS), torch.tensor(INPUT_IDS))
    loss = sft_loss(logprobs, torch.zeros(2, 3, dtype=torch.long))
    assert loss.item() == 0.0


def test_sft_loss_gradient_reaches_only_response_positions():
    logits = torch.tensor(LOGITS, requires_grad=True)
    mask = torch.tensor([[0, 1, 0, 0], [0, 0, 0, 1]])[:, 1:]
    sft_loss(shifted_logprobs(logits, torch.tensor(INPUT_IDS)), mask).backward()
    touched = logits.grad.abs().sum(-1) > 0
    # Position t is trained iff the token at t + 1 is a response token.
    assert touched.tolist() == [[True, False, False, False], [False, False, True, False]]
    # d(-log softmax)/dlogits = (softmax - onehot) / n_tokens, here n_tokens = 2.
    row = LOGITS[0][0]
    z = sum(math.exp(x) for x in row)
    expected = [(math.exp(x) / z - (1.0 if v == INPUT_IDS[0][1] else 0.0)) / 2 for v, x in enumerate(row)]
    assert logits.grad[0, 0].tolist() == pytest.approx(expected, abs=1e-6)


def test_dft_weighs_each_tokens_nll_by_its_probability_held_constant():
    """Value -sum p log p / n over the response tokens; gradient -grad p / n: at position t with target y,
    d/dz_v of -p_y / n = -p_y (1[v = y] - p_v) / n."""
    loss_mask = [[0, 1, 1, 1], [0, 0, 1, 0]]
    logits = torch.tensor(LOGITS, requires_grad=True)
    loss = dft_loss(shifted_logprobs(logits, torch.tensor(INPUT_IDS)), torch.tensor(loss_mask)[:, 1:])
    terms = [_logp(LOGITS[b][t], INPUT_IDS[b][t + 1]) for b in range(2) for t in range(3) if loss_mask[b][t + 1]]
    assert loss.item() == pytest.approx(-sum(math.exp(x) * x for x in terms) / 4, abs=1e-6)
    loss.backward()
    row, y = LOGITS[0][0], INPUT_IDS[0][1]
    p = [math.exp(_logp(row, v)) for v in range(3)]
    assert logits.grad[0, 0].tolist() == pytest.approx([-p[y] * ((v == y) - p[v]) / 4 for v in range(3)], abs=1e-6)
    # NLL's gradient at the same position is (p_v - 1[v = y]) / n: DFT's is it times p_y
    assert logits.grad[0, 0].tolist() == pytest.approx([p[y] * (p[v] - (v == y)) / 4 for v in range(3)], abs=1e-6)
    assert dft_loss(torch.zeros(2, 3), torch.zeros(2, 3)).item() == 0.0


def test_neftune_noise_is_uniform_within_alpha_over_root_length_times_width():
    """Two rows of width d = 512: lengths 3, 3, 3 and 2, 2, 0 (padding: no noise); each entry's noise lies
    within alpha / sqrt(n d) and, being uniform, has a mean absolute value of half that."""
    embeds = torch.zeros(2, 3, 512, dtype=torch.bfloat16)
    lengths = torch.tensor([[3, 3, 3], [2, 2, 0]])
    out = neftune_noise(embeds, lengths, 5.0, generator=torch.Generator().manual_seed(0))
    assert out.dtype == torch.bfloat16 and out.shape == embeds.shape
    for b, t in [(0, 0), (0, 2), (1, 0), (1, 1)]:
        scale = 5.0 / math.sqrt(int(lengths[b, t]) * 512)
        noise = out[b, t].float()
        assert noise.abs().max().item() <= scale * 1.004  # bf16 rounding
        assert noise.abs().mean().item() == pytest.approx(scale / 2, rel=0.1)
    assert out[1, 2].abs().sum().item() == 0
    with pytest.raises(ValueError, match="alpha must be > 0"):
        neftune_noise(embeds, lengths, 0.0)
