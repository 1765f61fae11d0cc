"""The VAPO math core against naive per-sequence loops, plus the conventions the spec says implementations get
wrong."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_vapo.core import (
    IMPORTANCE_SAMPLING_MODES,
    adaptive_entropy_coef,
    aggregate_loss,
    compute_gae,
    decoupled_gae,
    explained_variance,
    explained_variance_plateaued,
    group_normalized_rewards,
    high_entropy_mask,
    importance_sampling_weights,
    length_adaptive_lambda,
    lm_head_logprobs_and_entropy,
    masked_mean,
    masked_var,
    masked_whiten,
    off_policy_mask,
    policy_loss,
    positive_nll_loss,
    terminal_rewards,
    token_logprobs_and_entropy,
    value_loss,
    vapo_loss,
    vespo_weights,
)

# ---------------------------------------------------------------------------------------------------------------------
# Random padded batches and naive references
# ---------------------------------------------------------------------------------------------------------------------


def random_lengths(batch: int, steps: int, generator: torch.Generator) -> torch.Tensor:
    """Random lengths in [1, steps] that always include a length-1 and a full-length sequence."""
    lengths = torch.randint(1, steps + 1, (batch,), generator=generator)
    lengths[0] = 1
    if batch > 1:
        lengths[1] = steps
    return lengths


def mask_from_lengths(lengths: torch.Tensor, steps: int) -> torch.Tensor:
    return (torch.arange(steps)[None, :] < lengths[:, None]).float()


def random_batch(batch=6, steps=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = random_lengths(batch, steps, g)
    mask = mask_from_lengths(lengths, steps)
    rewards = torch.randn(batch, steps, generator=g)
    values = torch.randn(batch, steps, generator=g)
    return lengths, mask, rewards, values, g


def scramble_padding(x: torch.Tensor, mask: torch.Tensor, fill: float = float("nan")) -> torch.Tensor:
    """The same tensor with garbage (NaN by default) at every padded position."""
    return torch.where(mask.bool(), x, torch.full_like(x, fill))


def naive_gae(rewards, values, lengths, gamma, lams):
    """Textbook GAE, one sequence at a time, over its valid tokens only."""
    batch, steps = rewards.shape
    advantages = torch.zeros(batch, steps, dtype=torch.float64)
    returns = torch.zeros(batch, steps, dtype=torch.float64)
    for i in range(batch):
        length = int(lengths[i])
        r = rewards[i, :length].double().tolist()
        v = values[i, :length].double().tolist()
        running = 0.0
        for t in reversed(range(length)):
            next_value = v[t + 1] if t + 1 < length else 0.0
            delta = r[t] + gamma * next_value - v[t]
            running = delta + gamma * float(lams[i]) * running
            advantages[i, t] = running
            returns[i, t] = running + v[t]
    return advantages, returns


def naive_reward_to_go(rewards, lengths):
    """sum_{k >= t} r_k, accumulated back to front in the rewards' own dtype."""
    out = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        running = torch.zeros((), dtype=rewards.dtype)
        for t in reversed(range(int(lengths[i]))):
            running = rewards[i, t] + running
            out[i, t] = running
    return out


# ---------------------------------------------------------------------------------------------------------------------
# masked statistics
# ---------------------------------------------------------------------------------------------------------------------


def test_masked_mean_var_whiten_match_flat_valid_elements():
    lengths, mask, x, _, _ = random_batch(batch=5, steps=7, seed=1)
    flat = torch.cat([x[i, : int(n)] for i, n in enumerate(lengths)]).double()
    torch.testing.assert_close(masked_mean(x, mask).double(), flat.mean(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(masked_var(x, mask).double(), flat.var(unbiased=True), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        masked_var(x, mask, unbiased=False).double(), flat.var(unbiased=False), rtol=1e-5, atol=1e-6
    )
    whitened = masked_whiten(x, mask)
    expected = (flat - flat.mean()) / torch.sqrt(flat.var(unbiased=True) + 1e-8)
    got = torch.cat([whitened[i, : int(n)] for i, n in enumerate(lengths)]).double()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.all(whitened[mask == 0] == 0)
    rescaled = masked_whiten(x, mask, shift_mean=False)
    got = torch.cat([rescaled[i, : int(n)] for i, n in enumerate(lengths)]).double()
    torch.testing.assert_close(got, expected + flat.mean(), rtol=1e-5, atol=1e-5)


def test_masked_mean_along_dim_and_empty_rows():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 0.0, 8.0]))
    # A reading of nothing is NaN where asked (a metric), a loss term of nothing 0 (the default)
    assert torch.isnan(masked_mean(x, mask, dim=1, empty=math.nan)).tolist() == [False, True, False]
    assert masked_mean(x, mask * 0).item() == 0 and math.isnan(masked_mean(x, mask * 0, empty=math.nan).item())
    assert masked_var(torch.tensor([[3.0]]), torch.tensor([[1]])) == 0


def other_rank(values_b: torch.Tensor, mask_b: torch.Tensor):
    """An ``all_reduce`` of two ranks whose other one holds ``values_b``: each call adds what that rank's same call
    contributes to `_masked_moments`' two passes (the count and the sum; then the squares about the pooled mean)."""
    pooled_mean = []

    def all_reduce(sums: torch.Tensor) -> torch.Tensor:
        valid = mask_b.bool()
        if not pooled_mean:
            sums = sums + torch.stack([valid.sum().double(), values_b.double()[valid].sum()])
            pooled_mean.append(sums[1] / sums[0])
            return sums
        return sums + ((values_b.double()[valid] - pooled_mean.pop()) ** 2).sum()

    return all_reduce


def test_whitening_statistics_pool_over_ranks():
    """Two shards whitened with an all-reduce equal the whole batch whitened at once."""
    lengths, mask, x, _, _ = random_batch(batch=8, steps=6, seed=2)
    shard_a, shard_b = slice(0, 3), slice(3, 8)

    pooled = masked_whiten(x[shard_a], mask[shard_a], all_reduce=other_rank(x[shard_b], mask[shard_b]))
    whole = masked_whiten(x, mask)
    torch.testing.assert_close(pooled, whole[shard_a], rtol=1e-5, atol=1e-6)

    values = x * 0.5
    ev_whole = explained_variance(values, x, mask)
    returns_b, residual_b = other_rank(x[shard_b], mask[shard_b]), other_rank((x - values)[shard_b], mask[shard_b])
    calls = iter([returns_b, returns_b, residual_b, residual_b])  # two passes of the returns, then of the residual
    ev_pooled = explained_variance(values[shard_a], x[shard_a], mask[shard_a], all_reduce=lambda s: next(calls)(s))
    torch.testing.assert_close(ev_pooled, ev_whole, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# length-adaptive lambda
# ---------------------------------------------------------------------------------------------------------------------


def test_length_adaptive_lambda_formula_and_clamp():
    lengths = torch.tensor([0, 1, 10, 20, 21, 100, 1000, 16384])
    lam = length_adaptive_lambda(lengths, alpha=0.05)
    expected = [min(max(1 - 1 / (0.05 * n), 0.0), 1.0) if n > 0 else 0.0 for n in lengths.tolist()]
    torch.testing.assert_close(lam, torch.tensor(expected, dtype=torch.float32))
    assert lam[3] == 0  # alpha * l = 1 gives lambda 0: the horizon of a 20-token answer is one token
    assert lam[5] == pytest.approx(0.8)
    assert torch.all((lam >= 0) & (lam <= 1))
    # the horizon 1 / (1 - lambda) is alpha * l, as the paper derives
    assert 1 / (1 - lam[6].item()) == pytest.approx(0.05 * 1000, rel=1e-4)


@pytest.mark.parametrize("alpha", [0.0, -0.1])
def test_length_adaptive_lambda_rejects_non_positive_alpha(alpha):
    with pytest.raises(ValueError, match="length_adaptive_alpha"):
        length_adaptive_lambda(torch.tensor([5]), alpha)


# ---------------------------------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (1.0, 1.0), (0.9, 0.0), (1.0, 0.0)])
def test_gae_matches_naive_loop(gamma, lam):
    lengths, mask, rewards, values, _ = random_batch(batch=7, steps=11, seed=3)
    advantages, returns = compute_gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = naive_gae(rewards, values, lengths, gamma, [lam] * len(lengths))
    torch.testing.assert_close(advantages.double(), ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(returns.double(), ref_ret, rtol=1e-5, atol=1e-5)


def test_gae_with_unit_gamma_and_lambda_is_reward_to_go_independent_of_values():
    lengths, mask, rewards, values, g = random_batch(batch=6, steps=10, seed=4)
    _, returns = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(returns, naive_reward_to_go(rewards, lengths), rtol=1e-6, atol=1e-6)  # (a cumsum)
    _, returns_other_values = compute_gae(rewards, torch.randn(values.shape, generator=g) * 100, mask, 1.0, 1.0)
    assert torch.equal(returns, returns_other_values)


def test_undiscounted_gae_loops_over_the_tokens_once_and_its_targets_not_at_all():
    """VAPO's gamma = 1: the critic's targets (lambda 1) are a reverse cumulative sum, a number of tensor operations
    that does not grow with the completion's length, and the decoupled GAE loops over the tokens once, for the actor's
    advantages (three loops a rollout, one a kernel launch or more a token on a GPU: the targets in the scoring pass,
    then both lambdas). Counted as the operations torch dispatches, not timed."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        operations = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.operations += 1
            return func(*args, **(kwargs or {}))

    def operations(length, gae):
        mask = torch.ones(4, length)
        with Count() as count:
            gae(terminal_rewards(torch.randn(4), mask), torch.randn(4, length), mask)
        return count.operations

    def per_token(gae):
        return (operations(128, gae) - operations(16, gae)) / 112

    assert per_token(lambda r, v, m: compute_gae(r, v, m, 1.0, 1.0)) == 0
    one_loop = per_token(lambda r, v, m: compute_gae(r, v, m, 1.0, 0.95))
    assert one_loop > 0 and per_token(lambda r, v, m: decoupled_gae(r, v, m, 1.0, 0.95, 1.0)) == one_loop
    assert per_token(lambda r, v, m: decoupled_gae(r, v, m, 1.0, 0.95, 1.0, 0.05)) == one_loop  # length-adaptive


def test_gae_with_unit_lambda_and_terminal_reward_targets_the_score_everywhere():
    """VAPO's critic target with lam_critic = 1: with only a terminal reward R, G_t = R at every valid position."""
    lengths = torch.tensor([1, 4, 6])
    mask = mask_from_lengths(lengths, 6)
    scores = torch.tensor([1.0, -1.0, 1.0])
    rewards = torch.zeros(3, 6)
    rewards[torch.arange(3), lengths - 1] = scores
    _, returns = compute_gae(rewards, torch.randn(3, 6), mask, gamma=1.0, lam=1.0)
    assert torch.equal(returns, scores[:, None] * mask)


def test_gae_with_zero_lambda_gives_td_errors():
    lengths, mask, rewards, values, _ = random_batch(batch=6, steps=8, seed=5)
    advantages, _ = compute_gae(rewards, values, mask, gamma=0.97, lam=0.0)
    td = torch.zeros_like(rewards)
    for i, n in enumerate(lengths.tolist()):
        for t in range(n):
            next_value = values[i, t + 1] if t + 1 < n else 0.0
            td[i, t] = rewards[i, t] + 0.97 * next_value - values[i, t]
    torch.testing.assert_close(advantages, td, rtol=1e-6, atol=1e-6)


def test_gae_per_sequence_lambda_equals_scalar_lambda_row_by_row():
    lengths, mask, rewards, values, _ = random_batch(batch=6, steps=12, seed=6)
    lams = torch.tensor([0.0, 0.5, 0.8, 0.95, 0.99, 1.0])
    advantages, returns = compute_gae(rewards, values, mask, 1.0, lams)
    for i, lam in enumerate(lams.tolist()):
        row_adv, row_ret = compute_gae(rewards, values, mask, 1.0, lam)
        assert torch.equal(advantages[i], row_adv[i])
        assert torch.equal(returns[i], row_ret[i])
    ref_adv, ref_ret = naive_gae(rewards, values, lengths, 1.0, lams.tolist())
    torch.testing.assert_close(advantages.double(), ref_adv, rtol=1e-5, atol=1e-5)


def test_gae_length_adaptive_lambda_end_to_end():
    lengths, mask, rewards, values, _ = random_batch(batch=5, steps=40, seed=7)
    lams = length_adaptive_lambda(lengths, alpha=0.1)
    advantages, _ = compute_gae(rewards, values, mask, 1.0, lams)
    ref_adv, _ = naive_gae(rewards, values, lengths, 1.0, lams.tolist())
    torch.testing.assert_close(advantages.double(), ref_adv, rtol=1e-5, atol=1e-5)


def test_gae_ignores_everything_at_padded_positions():
    lengths, mask, rewards, values, _ = random_batch(batch=6, steps=9, seed=8)
    advantages, returns = compute_gae(rewards, values, mask, 1.0, 0.95)
    for fill in (float("nan"), float("inf"), 1e6, -3.0):
        adv2, ret2 = compute_gae(
            scramble_padding(rewards, mask, fill), scramble_padding(values, mask, fill), mask, 1.0, 0.95
        )
        assert torch.equal(advantages, adv2)
        assert torch.equal(returns, ret2)
    assert torch.all(advantages[mask == 0] == 0) and torch.all(returns[mask == 0] == 0)


def test_gae_does_not_bootstrap_from_the_first_pad_position():
    """The last valid token's TD error is r - V(s_last): the value at the next (pad) position is never used."""
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    rewards = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    values = torch.tensor([[0.2, 0.3, 5.0, 7.0]])
    advantages, returns = compute_gae(rewards, values, mask, gamma=1.0, lam=0.0)
    torch.testing.assert_close(advantages, torch.tensor([[0.3 - 0.2, 1.0 - 0.3, 0.0, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.3, 1.0, 0.0, 0.0]]))


def naive_gae_over_actions(rewards, values, mask, gamma, lam):
    """Textbook GAE over each sequence's valid tokens only, wherever they lie: the next state is the next valid
    token's (a multi-turn episode, whose environment tokens are not actions)."""
    advantages = torch.zeros(mask.shape, dtype=torch.float64)
    returns = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        actions = mask[i].nonzero().flatten().tolist()
        running, next_value = 0.0, 0.0
        for t in reversed(actions):
            delta = float(rewards[i, t]) + gamma * next_value - float(values[i, t])
            running = delta + gamma * lam * running
            advantages[i, t], returns[i, t] = running, running + float(values[i, t])
            next_value = float(values[i, t])
    return advantages, returns


@pytest.mark.parametrize("gamma,lam", [(0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_steps_over_the_tokens_a_mask_leaves_out_inside_a_completion(gamma, lam):
    """An environment's tokens inside a completion (holes in the mask) are no actions: V(s_{t+1}) is the value at the
    next action, the sums skip them, and nothing at them, NaN included, reaches the result."""
    g = torch.Generator().manual_seed(41)
    mask = (torch.rand(8, 12, generator=g) < 0.6).float()
    mask[0], mask[1] = 0.0, torch.tensor([1.0] * 3 + [0.0] * 4 + [1.0] * 2 + [0.0] * 3)  # empty; two turns
    rewards = terminal_rewards(torch.randn(8, generator=g), mask)
    values = torch.randn(8, 12, generator=g)
    advantages, returns = compute_gae(rewards, scramble_padding(values, mask), mask, gamma, lam)
    expected_advantages, expected_returns = naive_gae_over_actions(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(advantages.double(), expected_advantages, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(returns.double(), expected_returns, rtol=1e-5, atol=1e-5)


def test_terminal_rewards_sit_on_the_last_action_not_on_an_environments_tokens_after_it():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0]])
    rewards = terminal_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    expected = torch.zeros(3, 6)
    expected[0, 4], expected[1, 1], expected[2, 2] = 2.0, 3.0, 4.0
    assert torch.equal(rewards, expected)


# ---------------------------------------------------------------------------------------------------------------------
# policy loss
# ---------------------------------------------------------------------------------------------------------------------


def naive_policy_loss(logprobs, old_logprobs, advantages, lengths, eps_low, eps_high, loss_type, delta=None):
    token_losses, per_sequence = [], []
    for i, n in enumerate(lengths.tolist()):
        row = []
        for t in range(n):
            log_ratio = float(logprobs[i, t]) - float(old_logprobs[i, t])
            ratio = math.exp(min(max(log_ratio, -20.0), 20.0))  # verl's clamp: e^90 is inf
            a = float(advantages[i, t])
            capped = ratio if delta is None else min(ratio, delta)
            row.append(-min(capped * a, min(max(ratio, 1 - eps_low), 1 + eps_high) * a))
        token_losses.extend(row)
        if row:
            per_sequence.append(sum(row) / len(row))
    if loss_type == "token":
        return sum(token_losses) / len(token_losses)
    if loss_type == "luspo":
        return sum(token_losses) / len(per_sequence)
    return sum(per_sequence) / len(per_sequence)


@pytest.mark.parametrize("loss_type", ["token", "sequence", "luspo"])
def test_aggregate_loss_matches_naive_loop(loss_type):
    """The one place per-token losses are averaged (the policy, value and NLL losses call it), with a row of no
    token (it counts in no denominator) and a given normalizer (the whole step's count)."""
    g = torch.Generator().manual_seed(3)
    lengths = [4, 0, 7, 1, 10]
    mask = (torch.arange(10)[None, :] < torch.tensor(lengths)[:, None]).float()
    per_token = torch.randn(5, 10, generator=g) * mask
    rows = [[per_token[i, t].item() for t in range(n)] for i, n in enumerate(lengths)]
    sequences = [row for row in rows if row]
    expected = {
        "token": sum(map(sum, rows)) / sum(lengths),
        "sequence": sum(sum(row) / len(row) for row in sequences) / len(sequences),
        "luspo": sum(map(sum, rows)) / len(sequences),
    }[loss_type]
    assert aggregate_loss(per_token, mask, loss_type).item() == pytest.approx(expected, rel=1e-6)
    given = aggregate_loss(per_token, mask, loss_type, normalizer=torch.tensor(40.0))
    count = sum(lengths) if loss_type == "token" else len(sequences)
    assert given.item() == pytest.approx(expected * count / 40, rel=1e-6)
    with pytest.raises(ValueError, match="loss_type must be"):
        aggregate_loss(per_token, mask, "mean")


@pytest.mark.parametrize("loss_type", ["token", "sequence", "luspo"])
def test_policy_loss_matches_naive_loop(loss_type):
    lengths, mask, advantages, old, g = random_batch(batch=7, steps=10, seed=9)
    logprobs = old + 0.4 * torch.randn(old.shape, generator=g)
    loss, stats = policy_loss(logprobs, old, advantages, mask, 0.2, 0.28, loss_type=loss_type)
    expected = naive_policy_loss(logprobs, old, advantages, lengths, 0.2, 0.28, loss_type)
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    ratio = torch.exp(logprobs - old)
    valid = mask.bool()
    high = ((advantages > 0) & (ratio > 1.28))[valid].float().mean()
    low = ((advantages < 0) & (ratio < 0.8))[valid].float().mean()
    assert stats["clip_frac_high"].item() == pytest.approx(high.item())
    assert stats["clip_frac_low"].item() == pytest.approx(low.item())
    assert stats["clip_frac"].item() == pytest.approx((high + low).item())
    kl = ((ratio - 1) - (logprobs - old))[valid].mean()
    assert stats["approx_kl"].item() == pytest.approx(kl.item(), rel=1e-5)
    # GRPOTrainer's clip_ratio/low_min and high_max: each sequence's clipped share's extremes (empty ones left out)
    lengths[0] = 0
    loss, stats = policy_loss(logprobs, old, advantages, mask_from_lengths(lengths, 10), 0.2, 0.28)
    shares = [
        (
            sum(advantages[i, t] < 0 and ratio[i, t] < 0.8 for t in range(n)) / n,
            sum(advantages[i, t] > 0 and ratio[i, t] > 1.28 for t in range(n)) / n,
        )
        for i, n in enumerate(lengths)
        if n
    ]
    assert stats["clip_frac_low_min"].item() == pytest.approx(float(min(low for low, _ in shares)))
    assert stats["clip_frac_high_max"].item() == pytest.approx(float(max(high for _, high in shares)))
    assert stats["clip_frac_high_max"] > stats["clip_frac_high"] > 0  # the maximum is a sequence's, not the mean
    _, stats = policy_loss(logprobs, old, advantages, torch.zeros_like(mask), 0.2, 0.28)
    assert stats["clip_frac_low_min"] == 1 and stats["clip_frac_high_max"] == 0  # no sequence: neutral values


def naive_surrogate_terms(surrogate, logprobs, old, advantages, lengths, is_weights=None):
    """Each sequence's tokens' (loss, d loss / d logprob) under GRPO's other objectives, token by token in floats
    (CISPO's cap 5.0, SAPO's temperatures 1.0 / 1.05, VESPO's (k, lambda) (2, 3) / (3, 2)): the formulas of
    GRPOTrainer's `_compute_loss` and `get_gamma_weights`."""
    rows = []
    for i, n in enumerate(lengths.tolist()):
        ratios = [math.exp(float(logprobs[i, t]) - float(old[i, t])) for t in range(n)]
        corrections = [1.0 if is_weights is None else float(is_weights[i, t]) for t in range(n)]
        log_w = sum(max(-20.0, min(20.0, math.log(r))) for r in ratios)
        log_w += sum(max(math.log(1e-8), min(20.0, math.log(c))) for c in corrections) if is_weights is not None else 0
        w = math.exp(max(math.log(1e-8), min(20.0, log_w)))
        row = []
        for t, (r, c) in enumerate(zip(ratios, corrections)):
            a, logp = float(advantages[i, t]), float(logprobs[i, t])
            if surrogate == "cispo":
                row.append((-min(r, 5.0) * a * logp * c, -min(r, 5.0) * a * c))
            elif surrogate == "sapo":
                tau = 1.0 if a > 0 else 1.05
                gate = 1 / (1 + math.exp(-tau * (r - 1)))
                row.append((-(4 / tau) * gate * a * c, -4 * gate * (1 - gate) * r * a * c))
            else:
                k, lam = (2.0, 3.0) if a >= 0 else (3.0, 2.0)
                phi = math.exp(lam + k * math.log(w) - lam * w)
                row.append((-phi * a * logp, -phi * a))
        rows.append(row)
    return rows


@pytest.mark.parametrize("surrogate", ["cispo", "sapo", "vespo"])
@pytest.mark.parametrize("loss_type", ["token", "sequence"])
@pytest.mark.parametrize("corrected", [False, True])
def test_grpos_other_objectives_match_a_naive_loop_in_value_and_gradient(surrogate, loss_type, corrected):
    """CISPO, SAPO and VESPO on VAPO's per-token advantages, against the token-by-token formulas: the loss and its
    gradient in each log-prob (CISPO's and VESPO's weights carry none), with vLLM's importance ratios multiplying
    CISPO's and SAPO's terms and entering VESPO's sequence ratio. Log-ratios of sd 1: CISPO's cap (5.0) binds."""
    lengths, mask, advantages, old, g = random_batch(batch=7, steps=10, seed=22)
    old = -old.abs()  # log-probs
    logprobs = (old + torch.randn(old.shape, generator=g)).requires_grad_()
    is_weights = (0.5 + torch.rand(old.shape, generator=g)) if corrected else None
    batch = {"is_weights": is_weights}
    loss, stats = policy_loss(
        logprobs, old, advantages, mask, 0.2, 5.0, loss_type, surrogate=surrogate, is_weights=batch["is_weights"]
    )
    rows = naive_surrogate_terms(surrogate, logprobs.detach(), old, advantages, lengths, is_weights)
    sequences = [row for row in rows if row]
    if loss_type == "token":
        scale = [[1 / sum(lengths.tolist())] * len(row) for row in rows]
    else:
        scale = [[1 / (len(row) * len(sequences))] * len(row) for row in rows]
    expected = sum(term * s for row, ss in zip(rows, scale) for (term, _), s in zip(row, ss))
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-7)
    loss.backward()
    expected_grad = torch.zeros_like(old)
    for i, (row, ss) in enumerate(zip(rows, scale)):
        for t, ((_, grad), s) in enumerate(zip(row, ss)):
            expected_grad[i, t] = grad * s
    torch.testing.assert_close(logprobs.grad, expected_grad, rtol=1e-4, atol=1e-7)
    if surrogate == "vespo":  # GRPOTrainer's phi_seq_mean: each sequence counts once, whatever its length
        phis = [[-grad / float(advantages[i, t]) for t, (_, grad) in enumerate(row)] for i, row in enumerate(rows)]
        per_sequence = [sum(phi) / len(phi) for phi in phis if phi]
        assert stats["phi"].item() == pytest.approx(sum(per_sequence) / len(per_sequence), rel=1e-5)
    if surrogate == "cispo":
        ratio = torch.exp(logprobs.detach() - old)
        assert (
            0
            < stats["clip_frac_high"].item()
            == pytest.approx(((advantages > 0) & (ratio > 5.0))[mask.bool()].float().mean().item())
        )


def test_vespos_weight_is_one_on_policy_and_small_far_from_it():
    """phi(1) = 1: with the sampler's own log-probs VESPO's update is the policy gradient's, -A log pi averaged;
    a sequence 4 nats away on either side weighs almost nothing."""
    lengths, mask, advantages, old, g = random_batch(batch=5, steps=8, seed=4)
    old = -old.abs()
    loss, stats = policy_loss(old, old, advantages, mask, 0.2, 0.28, "token", surrogate="vespo")
    assert stats["phi"].item() == pytest.approx(1.0)
    assert loss.item() == pytest.approx(((-advantages * old) * mask).sum().item() / mask.sum().item(), rel=1e-6)
    for shift in (-4.0, 4.0):
        far = old + shift / lengths.clamp(min=1)[:, None]  # a sequence log-ratio of `shift`
        _, stats = policy_loss(far, old, advantages, mask, 0.2, 0.28, "token", surrogate="vespo")
        assert stats["phi"].item() < 0.05, shift
    with pytest.raises(ValueError, match="surrogate must be one of 'ppo', 'cispo', 'sapo', 'vespo'"):
        policy_loss(old, old, advantages, mask, 0.2, 0.28, surrogate="gspo")
    # vLLM's ratio per sequence (a sequence-level mode, [B, 1]) enters w once: as the product of per-token ones.
    per_token = torch.exp(0.3 * torch.randn(old.shape, generator=g)) * mask + (1 - mask)
    per_sequence = per_token.prod(dim=1, keepdim=True)
    shifted = old + 0.2 * torch.randn(old.shape, generator=g) * mask
    log_ratio = (shifted - old) * mask
    torch.testing.assert_close(
        vespo_weights(log_ratio, advantages, mask, per_sequence, 2.0, 3.0, 3.0, 2.0),
        vespo_weights(log_ratio, advantages, mask, per_token, 2.0, 3.0, 3.0, 2.0),
    )


@pytest.mark.parametrize("loss_type", ["token", "sequence"])
def test_two_sided_clipping_caps_the_ratio_of_negative_advantages_only(loss_type):
    """`delta` (GRPOConfig's two-sided clipping) against the naive loop, on ratios far from 1 (up to e^3): it lowers
    the loss of negative advantages whose ratio exceeds delta, and leaves every positive advantage's term alone."""
    lengths, mask, advantages, old, g = random_batch(batch=7, steps=10, seed=9)
    logprobs = old + 1.5 * torch.randn(old.shape, generator=g)
    loss, _ = policy_loss(logprobs, old, advantages, mask, 0.2, 0.28, loss_type=loss_type, delta=2.0)
    expected = naive_policy_loss(logprobs, old, advantages, lengths, 0.2, 0.28, loss_type, delta=2.0)
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    uncapped, _ = policy_loss(logprobs, old, advantages, mask, 0.2, 0.28, loss_type=loss_type)
    assert loss.item() < uncapped.item()  # some negative advantages have ratios above 2
    positive = torch.where(advantages > 0, advantages, torch.zeros_like(advantages))
    with_delta, _ = policy_loss(logprobs, old, positive, mask, 0.2, 0.28, loss_type=loss_type, delta=2.0)
    without, _ = policy_loss(logprobs, old, positive, mask, 0.2, 0.28, loss_type=loss_type)
    assert with_delta.item() == without.item()


@pytest.mark.parametrize("loss_type", ["token", "sequence"])
def test_a_sequence_level_ratio_is_gspo_tokens(loss_type):
    """`importance_sampling_level="sequence"`: every token takes its sequence's geometric-mean ratio s_i (the naive
    loop with that ratio), and the gradient of a token's log-prob is s_i times its token-level one where unclipped
    (GSPO-token, GSPO Eq. 13-14), so VAPO's per-token advantages still apply."""
    lengths, mask, advantages, old, g = random_batch(batch=6, steps=9, seed=12)
    logprobs = (old + 0.1 * torch.randn(old.shape, generator=g)).requires_grad_()
    loss, stats = policy_loss(
        logprobs, old, advantages, mask, 0.2, 0.28, loss_type, importance_sampling_level="sequence"
    )
    s = torch.exp(((logprobs - old) * mask).sum(1) / mask.sum(1).clamp(min=1)).detach()
    as_sequence_ratio = old + torch.log(s)[:, None]  # per-token log-probs whose token ratio is s_i everywhere
    expected = naive_policy_loss(as_sequence_ratio, old, advantages, lengths, 0.2, 0.28, loss_type)
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert stats["ratio"].item() == pytest.approx(((s[:, None] * mask).sum() / mask.sum()).item(), rel=1e-5)
    loss.backward()
    unclipped = ((s > 0.8) & (s < 1.28))[:, None] & mask.bool()
    denominator = mask.sum() if loss_type == "token" else (lengths > 0).sum() * mask.sum(1, keepdim=True).clamp(min=1)
    expected_grad = -advantages * s[:, None] / denominator
    torch.testing.assert_close(logprobs.grad[unclipped], expected_grad.expand_as(logprobs)[unclipped])
    with pytest.raises(ValueError, match="importance_sampling_level"):
        policy_loss(logprobs, old, advantages, mask, 0.2, 0.28, importance_sampling_level="sentence")


@pytest.mark.parametrize("surrogate", ["ppo", "sapo"])
def test_a_token_far_from_the_sampler_neither_overflows_the_loss_nor_moves_the_step(surrogate):
    """A token 90 nats from the sampler (rho = e^90 overflows float32) with a negative advantage made the loss inf,
    and the trainer skipped the whole step. Its log-ratio is clamped at 20 (verl's): the loss is the naive loop's with
    that clamp, finite, and the token carries no gradient while every other token's is what it was without it."""
    lengths, mask, advantages, old, g = random_batch(batch=4, steps=6, seed=21)
    logprobs = old + 0.1 * torch.randn(old.shape, generator=g)
    i, j = (lengths > 0).nonzero().flatten()[:2].tolist()
    far = logprobs.clone()
    far[i, 0], advantages[i, 0] = old[i, 0] + 90.0, -1.0  # rho = e^90, A < 0: the unclipped term is the larger
    far[j, 0], advantages[j, 0] = old[j, 0] - 90.0, 1.0
    far.requires_grad_()
    loss, stats = policy_loss(far, old, advantages, mask, 0.2, 0.28, surrogate=surrogate)
    assert torch.isfinite(loss) and torch.isfinite(stats["approx_kl"]) and torch.isfinite(stats["ratio"])
    if surrogate == "ppo":
        expected = naive_policy_loss(far.detach(), old, advantages, lengths, 0.2, 0.28, "token")
        assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    assert far.grad[i, 0] == 0 and far.grad[j, 0] == 0
    near = torch.ones_like(mask, dtype=torch.bool)
    near[i, 0] = near[j, 0] = False
    without = logprobs.clone().requires_grad_()  # the same tokens, the far ones on the sampler
    policy_loss(without, old, advantages, mask * near, 0.2, 0.28, surrogate=surrogate, normalizer=mask.sum())[
        0
    ].backward()
    torch.testing.assert_close(far.grad[near], without.grad[near])


def test_policy_loss_ignores_padding():
    lengths, mask, advantages, old, g = random_batch(batch=5, steps=8, seed=10)
    logprobs = old + 0.3 * torch.randn(old.shape, generator=g)
    for loss_type in ("token", "sequence"):
        loss, stats = policy_loss(logprobs, old, advantages, mask, 0.2, 0.28, loss_type=loss_type)
        loss2, stats2 = policy_loss(
            scramble_padding(logprobs, mask),
            scramble_padding(old, mask, 50.0),
            scramble_padding(advantages, mask, float("inf")),
            mask,
            0.2,
            0.28,
            loss_type=loss_type,
        )
        assert torch.equal(loss, loss2)
        for key in stats:
            assert torch.equal(stats[key], stats2[key]), key


def test_token_level_and_sequence_level_weights():
    """One 8-token and one 2-token response, advantage 1 everywhere, ratio 1.

    Token-level (VAPO): every token weighs 1/|M| = 1/10. Sequence-level (vanilla PPO): a token of sequence i weighs
    1/(B * |o_i|): 1/16 in the long one, 1/4 in the short one, four times more.
    """
    mask = mask_from_lengths(torch.tensor([8, 2]), 8)
    old = torch.zeros(2, 8)
    advantages = torch.ones(2, 8)
    weights = {}
    for loss_type in ("token", "sequence"):
        logprobs = torch.zeros(2, 8, requires_grad=True)
        loss, _ = policy_loss(logprobs, old, advantages, mask, 0.2, 0.28, loss_type=loss_type)
        loss.backward()
        weights[loss_type] = -logprobs.grad  # d(-A * ratio)/d logprob = -A * ratio = -1 * weight
    torch.testing.assert_close(weights["token"], mask / 10)
    expected_sequence = torch.zeros(2, 8)
    expected_sequence[0, :8] = 1 / 16
    expected_sequence[1, :2] = 1 / 4
    torch.testing.assert_close(weights["sequence"], expected_sequence)


def test_clip_higher_bounds_and_zero_gradients_beyond_the_clip():
    eps_low, eps_high = 0.2, 0.28
    # token 0: A > 0, ratio 1.5 (beyond 1 + eps_high)  -> clipped, zero grad
    # token 1: A > 0, ratio 1.25 (inside)                -> unclipped, grad
    # token 2: A < 0, ratio 0.5 (beyond 1 - eps_low)     -> clipped, zero grad
    # token 3: A < 0, ratio 0.9 (inside)                 -> unclipped, grad
    # token 4: A < 0, ratio 1.5 (above 1 + eps_high)     -> pessimistic min keeps it unclipped, grad
    # token 5: A > 0, ratio 0.5 (below 1 - eps_low)      -> pessimistic min keeps it unclipped, grad
    ratios = torch.tensor([[1.5, 1.25, 0.5, 0.9, 1.5, 0.5]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0, 1.0]])
    old = torch.zeros(1, 6)
    mask = torch.ones(1, 6)
    logprobs = torch.log(ratios).clone().requires_grad_(True)
    per_token = []
    for t in range(6):
        m = torch.zeros(1, 6)
        m[0, t] = 1
        loss, _ = policy_loss(logprobs, old, advantages, m, eps_low, eps_high)
        per_token.append(loss.item())
    assert per_token[0] == pytest.approx(-(1 + eps_high))  # positive advantage: ratio capped at 1 + eps_high
    assert per_token[2] == pytest.approx(1 - eps_low)  # negative advantage: ratio floored at 1 - eps_low
    assert per_token[1] == pytest.approx(-1.25) and per_token[3] == pytest.approx(0.9)
    loss, stats = policy_loss(logprobs, old, advantages, mask, eps_low, eps_high)
    loss.backward()
    grad = logprobs.grad[0]
    assert grad[0] == 0 and grad[2] == 0
    assert all(grad[t] != 0 for t in (1, 3, 4, 5))
    assert stats["clip_frac_high"].item() == pytest.approx(1 / 6)
    assert stats["clip_frac_low"].item() == pytest.approx(1 / 6)


def test_symmetric_clip_is_the_vanilla_ppo_case():
    ratios = torch.tensor([[1.25]])
    loss_sym, _ = policy_loss(torch.log(ratios), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2, 0.2)
    loss_high, _ = policy_loss(torch.log(ratios), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2, 0.28)
    assert loss_sym.item() == pytest.approx(-1.2) and loss_high.item() == pytest.approx(-1.25)


@pytest.mark.parametrize("loss_type", ["token", "sequence"])
def test_normalizer_makes_micro_batches_sum_to_the_full_batch_loss(loss_type):
    lengths, mask, advantages, old, g = random_batch(batch=8, steps=10, seed=11)
    logprobs = old + 0.3 * torch.randn(old.shape, generator=g)
    full, _ = policy_loss(logprobs, old, advantages, mask, 0.2, 0.28, loss_type=loss_type)
    normalizer = mask.sum() if loss_type == "token" else torch.tensor(8.0)
    parts = [
        policy_loss(logprobs[s], old[s], advantages[s], mask[s], 0.2, 0.28, loss_type, normalizer=normalizer)[0]
        for s in (slice(0, 3), slice(3, 5), slice(5, 8))
    ]
    torch.testing.assert_close(sum(parts), full, rtol=1e-6, atol=1e-6)
    # The naive alternative, a mean per micro-batch, is a different (sequence-count) weighting.
    per_micro_mean = (
        sum(
            policy_loss(logprobs[s], old[s], advantages[s], mask[s], 0.2, 0.28, loss_type)[0]
            for s in (slice(0, 3), slice(3, 5), slice(5, 8))
        )
        / 3
    )
    assert not torch.allclose(per_micro_mean, full)


def test_policy_loss_rejects_unknown_loss_type():
    with pytest.raises(ValueError, match="loss_type"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), 0.2, 0.2, "grpo")


# ---------------------------------------------------------------------------------------------------------------------
# value loss
# ---------------------------------------------------------------------------------------------------------------------


def naive_value_loss(values, old_values, returns, lengths, clip):
    terms = []
    for i, n in enumerate(lengths.tolist()):
        for t in range(n):
            v, v_old, g = float(values[i, t]), float(old_values[i, t]), float(returns[i, t])
            unclipped = (v - g) ** 2
            if clip is None:
                terms.append(unclipped)
            else:
                clipped_v = v_old + min(max(v - v_old, -clip), clip)
                terms.append(max(unclipped, (clipped_v - g) ** 2))
    return 0.5 * sum(terms) / len(terms)


@pytest.mark.parametrize("clip", [None, 0.2, 10.0])
def test_value_loss_matches_naive_loop(clip):
    lengths, mask, returns, old_values, g = random_batch(batch=6, steps=9, seed=12)
    values = old_values + 0.5 * torch.randn(old_values.shape, generator=g)
    loss, _ = value_loss(values, old_values, returns, mask, clip)
    assert loss.item() == pytest.approx(naive_value_loss(values, old_values, returns, lengths, clip), rel=1e-5)
    loss2, _ = value_loss(
        scramble_padding(values, mask), scramble_padding(old_values, mask), scramble_padding(returns, mask), mask, clip
    )
    assert torch.equal(loss, loss2)


@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("garbage", [math.nan, math.inf])
def test_value_loss_gradient_is_untouched_by_what_padded_positions_hold(clip, garbage):
    """A critic's NaN or inf at a padded position (an overflow on garbage there) gave the value head a NaN gradient:
    masked after the square, whose gradient is 0 * NaN."""
    lengths, mask, returns, old_values, g = random_batch(batch=6, steps=9, seed=14)
    assert (mask == 0).any()
    values = (old_values + 0.5 * torch.randn(old_values.shape, generator=g)).requires_grad_()
    value_loss(values, old_values, returns, mask, clip)[0].backward()
    clean = values.grad.clone()
    dirty = values.detach().masked_fill(mask == 0, garbage).requires_grad_()
    loss, _ = value_loss(dirty, old_values.masked_fill(mask == 0, garbage), returns, mask, clip)
    loss.backward()
    assert torch.isfinite(loss) and torch.equal(dirty.grad, clean)


def test_value_loss_without_clipping_ignores_old_values():
    lengths, mask, returns, old_values, g = random_batch(seed=13)
    values = torch.randn(old_values.shape, generator=g)
    a, _ = value_loss(values, old_values, returns, mask, None)
    b, _ = value_loss(values, old_values + 100, returns, mask, None)
    assert torch.equal(a, b)
    c, stats = value_loss(values, old_values + 100, returns, mask, 0.2)
    assert c > a and stats["vf_clip_frac"] > 0


# ---------------------------------------------------------------------------------------------------------------------
# positive-example NLL
# ---------------------------------------------------------------------------------------------------------------------


def test_positive_nll_matches_naive_loop_and_ignores_padding():
    lengths, mask, logprobs, _, _ = random_batch(batch=6, steps=7, seed=14)
    logprobs = -logprobs.abs()
    is_positive = torch.tensor([True, False, True, True, False, False])
    loss = positive_nll_loss(logprobs, mask, is_positive)
    terms = [-float(logprobs[i, t]) for i in range(6) if is_positive[i] for t in range(int(lengths[i]))]
    assert loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-6)
    assert torch.equal(loss, positive_nll_loss(scramble_padding(logprobs, mask), mask, is_positive))


def test_positive_nll_is_zero_with_a_gradient_path_when_nothing_is_positive():
    _, mask, logprobs, _, _ = random_batch(seed=15)
    logprobs = logprobs.clone().requires_grad_(True)
    loss = positive_nll_loss(logprobs, mask, torch.zeros(logprobs.shape[0], dtype=torch.bool))
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(logprobs.grad, torch.zeros_like(logprobs))


def test_positive_nll_normalizer_spans_micro_batches():
    _, mask, logprobs, _, _ = random_batch(batch=6, steps=7, seed=16)
    is_positive = torch.tensor([True, False, True, True, False, True])
    full = positive_nll_loss(logprobs, mask, is_positive)
    count = (mask * is_positive[:, None]).sum()
    parts = [
        positive_nll_loss(logprobs[s], mask[s], is_positive[s], normalizer=count) for s in (slice(0, 2), slice(2, 6))
    ]
    torch.testing.assert_close(sum(parts), full)


# ---------------------------------------------------------------------------------------------------------------------
# explained variance
# ---------------------------------------------------------------------------------------------------------------------


def test_explained_variance_matches_naive_and_edge_cases():
    lengths, mask, returns, values, _ = random_batch(batch=6, steps=9, seed=17)
    ev = explained_variance(values, returns, mask)
    g = torch.cat([returns[i, : int(n)] for i, n in enumerate(lengths)]).double()
    v = torch.cat([values[i, : int(n)] for i, n in enumerate(lengths)]).double()
    expected = 1 - (g - v).var(unbiased=False) / g.var(unbiased=False)
    assert ev.item() == pytest.approx(expected.item(), rel=1e-5)
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    assert explained_variance(
        torch.zeros_like(returns) + masked_mean(returns, mask), returns, mask
    ).item() == pytest.approx(0.0, abs=1e-6)
    assert torch.isnan(explained_variance(values, torch.ones_like(returns), mask))
    # Every return one constant that float32 cannot hold exactly (every answer wrong, a format reward of 0.1): NaN,
    # nothing to explain. One pass of E[G^2] - E[G]^2 left 2e-18 (a few ulps of 0.01) over 1,000 tokens: EV -1e15.
    constant = torch.full((10, 100), 0.1)
    assert torch.isnan(explained_variance(torch.rand(10, 100), constant, torch.ones(10, 100)))
    assert torch.equal(ev, explained_variance(scramble_padding(values, mask), scramble_padding(returns, mask), mask))


def naive_plateaued(readings, window, min_delta):
    finite = [r for r in readings if not math.isnan(r)]
    if len(finite) < 2 * window:
        return False

    def middle(values):
        ordered = sorted(values)
        half = len(ordered) // 2
        return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2

    return middle(finite[-window:]) - middle(finite[-2 * window : -window]) < min_delta


def test_value_pretraining_stop_rule_compares_window_medians_and_skips_nan():
    rising = [0.1 * i for i in range(8)]
    assert not explained_variance_plateaued(rising, 2, 0.01)
    # One rollout whose returns barely vary (7 of 8 samples alike) reads -9 where the critic reads 0.4: the windows'
    # means stopped a critic nine readings of which rose by 0.1 (0.30 -> -0.54), and held a flat one as long.
    rose = [0.3] * 10 + [0.4] * 9 + [-9.0]
    assert not explained_variance_plateaued(rose, 10, 0.01)
    assert explained_variance_plateaued([0.3] * 9 + [-9.0] + [0.3] * 10, 10, 0.01)
    # One lucky reading: the old best-so-far rule would wait `patience` readings to beat 0.9 and stop; the windows'
    # levels see that it is still rising.
    lucky = [0.1, 0.2, 0.9, 0.3, 0.35, 0.4, 0.45]
    assert not explained_variance_plateaued(lucky, 2, 0.01)
    flat = [0.1, 0.2, 0.5, 0.52, 0.51, 0.5]
    assert explained_variance_plateaued(flat, 2, 0.01)
    # NaN readings (returns all equal) neither count as a stall nor fill a window.
    assert not explained_variance_plateaued([math.nan] * 10, 2, 0.01)
    assert not explained_variance_plateaued([0.5, math.nan, 0.5, math.nan, 0.5], 2, 0.01)
    assert explained_variance_plateaued([0.5, math.nan, 0.5, math.nan, 0.5, 0.5], 2, 0.01)
    assert not explained_variance_plateaued([0.5] * 3, 2, 0.01)  # fewer than two windows


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.floats(-2, 1), st.just(math.nan)), max_size=30), st.integers(1, 5), st.floats(-0.1, 0.2))
def test_property_stop_rule_matches_naive(readings, window, min_delta):
    assert explained_variance_plateaued(readings, window, min_delta) == naive_plateaued(readings, window, min_delta)


# ---------------------------------------------------------------------------------------------------------------------
# Importance-sampling weights (TRL's vllm_importance_sampling_correction)
# ---------------------------------------------------------------------------------------------------------------------


def _direct_weights(trainer, sampler, mask, mode, clip_max, clip_min) -> list[list[float]]:
    """TRL's definition, one row and one token at a time."""
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    rows = []
    for t_row, s_row, m_row in zip(trainer.tolist(), sampler.tolist(), mask.tolist()):
        diffs = [0.0 if math.isnan((t - s) * m) else (t - s) * m for t, s, m in zip(t_row, s_row, m_row)]
        ratios = [math.exp(sum(diffs))] if mode.startswith("sequence") else [math.exp(d) for d in diffs]
        if mode.endswith("truncate"):
            ratios = [min(max(r, low), high) for r in ratios]
        else:
            ratios = [0.0 if r < low or r > high else r for r in ratios]
        rows.append(ratios)
    return rows


@pytest.mark.parametrize("mode", IMPORTANCE_SAMPLING_MODES)
@pytest.mark.parametrize("clip_min, clip_max", [(None, 3.0), (0.5, 2.0), (0.8, None)])
def test_importance_sampling_weights_match_trl_definition(mode, clip_min, clip_max):
    generator = torch.Generator().manual_seed(0)
    trainer = -3 * torch.rand(8, 6, generator=generator, dtype=torch.float64)
    sampler = trainer + 0.4 * torch.randn(8, 6, generator=generator, dtype=torch.float64)
    sampler[1, 2] = math.nan  # a token vLLM could not score: no correction for it
    sampler[3], sampler[4] = trainer[3] - 1.2, trainer[4] + 1.2  # ratios e^1.2 > 3 and e^-1.2 < 0.5
    mask = (torch.rand(8, 6, generator=generator) > 0.2).double()
    mask[0] = 0  # a completion that does not train

    weights = importance_sampling_weights(trainer, sampler, mask, mode, clip_max, clip_min)

    assert weights.shape == ((8, 1) if mode.startswith("sequence") else (8, 6))
    assert torch.isfinite(weights).all()
    expected = torch.tensor(_direct_weights(trainer, sampler, mask, mode, clip_max, clip_min), dtype=torch.float64)
    torch.testing.assert_close(weights, expected, atol=1e-12, rtol=1e-12)
    if mode.endswith("mask"):
        assert (weights == 0).any() and (weights > 0).any()
    else:
        assert (weights == (clip_max if clip_max is not None else clip_min)).any()  # a clipped weight


def test_importance_sampling_weights_refuse_bad_settings():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="clip_min or clip_max"):
        importance_sampling_weights(x, x, x + 1, "token_truncate", None, None)
    with pytest.raises(ValueError, match="token_clip"):
        importance_sampling_weights(x, x, x + 1, "token_clip")


def test_importance_sampling_weights_enter_the_policy_loss_as_trl_applies_them():
    """TRL multiplies the per-token clipped surrogate by rho, then takes the masked mean (grpo_trainer.py 3146).
    Through `vapo_loss`, which hands the rollout's `is_weights` to `policy_loss` as the trainer does (this test passed
    them as the token mask `weights`, which a dropped correction left passing)."""
    lengths, mask, advantages, logprobs, g = random_batch(batch=5, steps=7, seed=23)
    old = logprobs + 0.1 * torch.randn(logprobs.shape, generator=g)
    sampler = old + 0.3 * torch.randn(old.shape, generator=g)
    batch = {"mask": mask, "old_logprobs": old, "advantages": advantages, "is_positive": torch.zeros(5, dtype=bool)}
    settings = dict(epsilon_low=0.2, epsilon_high=0.28, loss_type="token", nll_coef=0.0, vf_coef=0.5)
    normalizers = {"tokens": mask.sum()}
    uncorrected, _ = vapo_loss(logprobs, None, batch, cliprange_value=None, normalizers=normalizers, **settings)
    for mode in IMPORTANCE_SAMPLING_MODES:
        rho = importance_sampling_weights(old, sampler, mask, mode, 2.0, 0.5)
        loss, _ = vapo_loss(
            logprobs, None, {**batch, "is_weights": rho}, cliprange_value=None, normalizers=normalizers, **settings
        )
        ratio = torch.exp(logprobs - old)
        surrogate = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.28))
        expected = ((surrogate * rho.expand_as(mask)) * mask).sum() / mask.sum()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5), mode
        assert loss.item() != pytest.approx(uncorrected.item(), rel=1e-3), mode


# ---------------------------------------------------------------------------------------------------------------------
# The two steps the trainer composes: decoupled GAE, and the VAPO loss
# ---------------------------------------------------------------------------------------------------------------------


def test_terminal_rewards_sit_on_the_last_valid_token():
    mask = mask_from_lengths(torch.tensor([3, 1, 0, 5]), 5)
    rewards = terminal_rewards(torch.tensor([1.0, -1.0, 7.0, 0.5]), mask)
    expected = torch.zeros(4, 5)
    expected[0, 2], expected[1, 0], expected[3, 4] = 1.0, -1.0, 0.5
    assert torch.equal(rewards, expected)


@pytest.mark.parametrize("alpha", [None, 0.3])
def test_decoupled_gae_is_two_gae_calls_with_the_actor_and_critic_lambdas(alpha):
    lengths, mask, rewards, values, _ = random_batch(batch=6, steps=9, seed=29)
    # Three different values (gamma 0.9, lam_actor 0.8, lam_critic 0.95): the paper's 1.0s would hide a swap.
    advantages, returns, lam = decoupled_gae(rewards, values, mask, 0.9, 0.8, 0.95, alpha)
    expected_lam = length_adaptive_lambda(lengths, alpha) if alpha is not None else torch.full((6,), 0.8)
    torch.testing.assert_close(lam, expected_lam)
    expected_advantages, _ = naive_gae(rewards, values, lengths, 0.9, expected_lam)
    _, expected_returns = naive_gae(rewards, values, lengths, 0.9, torch.full((6,), 0.95))
    torch.testing.assert_close(advantages.double(), expected_advantages, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(returns.double(), expected_returns, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("loss_type", ["token", "sequence"])
def test_vapo_loss_is_vf_coef_value_plus_policy_plus_mu_nll(loss_type):
    """Each term over the normalizer it is given (the step's counts over every micro-batch and process), not its own
    micro-batch's: the normalizers differ from this batch's counts, so a term that ignored its one would show."""
    lengths, mask, advantages, logprobs, g = random_batch(batch=6, steps=8, seed=31)
    values = torch.randn(mask.shape, generator=g)
    batch = {
        "mask": mask,
        "old_logprobs": logprobs + 0.05 * torch.randn(mask.shape, generator=g),
        "old_values": values + 0.3 * torch.randn(mask.shape, generator=g),
        "returns": torch.randn(mask.shape, generator=g),
        "advantages": advantages,
        "is_positive": torch.tensor([True, False, True, False, False, True]),
    }
    normalizers = {"tokens": 2 * mask.sum(), "sequences": torch.tensor(13.0), "positive_tokens": torch.tensor(29.0)}
    settings = dict(
        epsilon_low=0.2, epsilon_high=0.28, loss_type=loss_type, nll_coef=0.1, vf_coef=0.5, cliprange_value=0.2
    )
    loss, stats = vapo_loss(logprobs, values, batch, normalizers=normalizers, **settings)
    v, _ = value_loss(values, batch["old_values"], batch["returns"], mask, 0.2, normalizers["tokens"])
    policy_normalizer = normalizers["tokens" if loss_type == "token" else "sequences"]
    p, _ = policy_loss(logprobs, batch["old_logprobs"], advantages, mask, 0.2, 0.28, loss_type, policy_normalizer)
    nll = positive_nll_loss(logprobs, mask, batch["is_positive"], normalizers["positive_tokens"])
    assert loss.item() == pytest.approx((0.5 * v + p + 0.1 * nll).item(), rel=1e-6)
    assert stats["loss/value"].item() == pytest.approx(v.item()) and stats["loss/nll"].item() == pytest.approx(
        nll.item()
    )
    # Two-sided clipping: `delta` reaches the PPO term. Ratios of e^2 on the negative advantages, capped at 3.
    drifted = {**batch, "old_logprobs": logprobs - 2.0}
    capped, stats = vapo_loss(logprobs, values, drifted, normalizers=normalizers, delta=3.0, **settings)
    drifted_policy = (logprobs, drifted["old_logprobs"], advantages, mask, 0.2, 0.28, loss_type, policy_normalizer)
    p_capped, _ = policy_loss(*drifted_policy, delta=3.0)
    p_plain, _ = policy_loss(*drifted_policy)
    assert stats["loss/policy"].item() == pytest.approx(p_capped.item(), rel=1e-6)
    assert p_capped.item() != pytest.approx(p_plain.item(), rel=1e-3)  # the cap bites here
    # Value pretraining: no policy terms at all.
    critic_only, stats = vapo_loss(None, values, batch, normalizers=normalizers, **settings)
    assert critic_only.item() == pytest.approx(0.5 * v.item(), rel=1e-6) and "loss/policy" not in stats

    # An entropy bonus: minus entropy_coef times the step's token mean of the entropy (its gradient kept).
    entropy = torch.rand(mask.shape, generator=g).requires_grad_()
    bonus, stats = vapo_loss(
        logprobs, values, batch, normalizers=normalizers, entropy_coef=0.3, entropy=entropy, **settings
    )
    mean_entropy = (entropy * mask).sum() / mask.sum()
    share = mask.sum() / normalizers["tokens"]  # this micro-batch's share of the step's tokens: 0.5 here
    assert bonus.item() == pytest.approx((loss - 0.3 * share * mean_entropy).item(), rel=1e-6)
    assert stats["loss/entropy_bonus"].item() == pytest.approx((share * mean_entropy).item())
    bonus.backward()
    torch.testing.assert_close(entropy.grad, -0.3 * share * mask / mask.sum())
    with pytest.raises(ValueError, match="entropy with its gradient"):
        vapo_loss(
            logprobs, values, batch, normalizers=normalizers, entropy_coef=0.3, entropy=entropy.detach(), **settings
        )


# ---------------------------------------------------------------------------------------------------------------------
# GRPOConfig's policy-token filters and entropy control (not in VAPO)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [1, 3, 4])
def test_group_normalized_rewards_standardise_each_function_within_its_group_then_sum(group_size):
    g = torch.Generator().manual_seed(53)
    scores = torch.randn(12, 3, generator=g) * torch.tensor([1.0, 100.0, 0.01])  # three scales
    scores[torch.rand(12, 3, generator=g) < 0.3] = math.nan  # functions that gave no score
    scores[5] = math.nan  # a completion no function scored
    weights = torch.tensor([1.0, 0.5, 2.0])
    rewards = group_normalized_rewards(scores, weights, group_size)
    for i in range(12):
        group = range(i - i % group_size, i - i % group_size + group_size)
        if all(math.isnan(scores[i, k]) for k in range(3)):
            assert math.isnan(rewards[i])
            continue
        expected = 0.0
        for k in range(3):
            given = [scores[j, k].item() for j in group if not math.isnan(scores[j, k])]
            if math.isnan(scores[i, k]) or len(given) < 2:
                continue  # no score, or no spread to standardise by: nothing of this function
            mean = sum(given) / len(given)
            std = math.sqrt(sum((x - mean) ** 2 for x in given) / (len(given) - 1))
            expected += weights[k].item() * (scores[i, k].item() - mean) / (std + 1e-4)
        assert rewards[i].item() == pytest.approx(expected, rel=1e-4, abs=1e-5), i


def naive_quantile(values: list[float], q: float) -> float:
    """torch.quantile's default: linear interpolation between the order statistics around q * (n - 1)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (position - below) * (ordered[above] - ordered[below])


@pytest.mark.parametrize("q", [0.0, 0.5, 0.8, 1.0])
def test_high_entropy_mask_keeps_the_valid_tokens_at_or_above_the_quantile_pooled_over_processes(q):
    lengths, mask, entropy, _, _ = random_batch(batch=6, steps=9, seed=41)
    entropy = entropy.abs()
    entropy[~mask.bool()] = 100.0  # padding above every valid entropy: it must neither count nor be kept
    keep = high_entropy_mask(entropy, mask, q)
    valid = [entropy[i, t].item() for i in range(6) for t in range(int(lengths[i]))]
    threshold = naive_quantile(valid, q)
    for i in range(6):
        for t in range(9):
            assert keep[i, t].item() == (t < lengths[i] and entropy[i, t].item() >= threshold), (i, t)
    assert keep.sum() >= 1 and (q != 0.0 or torch.equal(keep, mask.bool()))
    # Two processes holding three rows each, pooled by `gather`: the same threshold as the whole batch.
    halves = [(entropy[:3], mask[:3]), (entropy[3:], mask[3:])]
    pooled = torch.cat([h[m.bool()] for h, m in halves])
    split = torch.cat([high_entropy_mask(h, m, q, gather=lambda local: pooled) for h, m in halves])
    assert torch.equal(split, keep)
    assert not high_entropy_mask(entropy, torch.zeros_like(mask), q).any()


def test_off_policy_mask_drops_negative_advantages_of_sequences_whose_sampler_drifted():
    lengths, mask, advantages, logprobs, g = random_batch(batch=6, steps=8, seed=43)
    drift_per_row = torch.tensor([0.0, 0.3, 0.6, 0.9, 1.2, -0.5])
    sampling = logprobs + drift_per_row[:, None] + 0.1 * torch.randn(mask.shape, generator=g)
    sampling[1, 0] = math.nan  # a token vLLM could not score: no drift
    logprobs = torch.where(mask.bool(), logprobs, torch.full_like(logprobs, -1e4))  # padding: anything
    keep = off_policy_mask(advantages, logprobs, sampling, mask, threshold=0.5)
    # GRPO's one advantage per sequence: a [B, 1] mask.
    per_sequence = off_policy_mask(advantages[:, :1], logprobs, sampling, mask, threshold=0.5)
    assert per_sequence.shape == (6, 1)
    for i in range(6):
        n = int(lengths[i])
        drifts = [0.0 if math.isnan(d) else d for d in (sampling[i, :n] - logprobs[i, :n]).tolist()]
        mean_drift = sum(drifts) / max(n, 1)
        for t in range(8):
            expected = advantages[i, t].item() >= 0 or mean_drift <= 0.5
            assert keep[i, t].item() == float(expected), (i, t)
        assert per_sequence[i, 0].item() == float(advantages[i, 0].item() >= 0 or mean_drift <= 0.5), i
    assert keep.dtype == mask.dtype and not keep.requires_grad


def test_adaptive_entropy_coef_climbs_at_or_below_the_target_and_falls_above_within_its_bounds():
    coef, readings = 0.01, [0.1, 0.2, 0.3, 0.3, 0.3, 0.1]
    trace = []
    for reading in readings:
        coef = adaptive_entropy_coef(coef, reading, target=0.2, delta=0.005, coef_min=0.0, coef_max=0.018)
        trace.append(coef)
    assert trace == pytest.approx([0.015, 0.018, 0.013, 0.008, 0.003, 0.008])
    assert adaptive_entropy_coef(0.002, 0.9, 0.2, 0.005, 0.0, 1.0) == 0.0


def test_grpos_token_masks_zero_the_masked_tokens_ppo_loss_and_the_entropy_mask_restricts_the_bonus():
    lengths, mask, advantages, logprobs, g = random_batch(batch=6, steps=8, seed=47)
    values = torch.randn(mask.shape, generator=g)
    batch = {
        "mask": mask,
        "old_logprobs": logprobs + 0.05 * torch.randn(mask.shape, generator=g),
        "old_values": values,
        "returns": torch.randn(mask.shape, generator=g),
        "advantages": advantages,
        "is_positive": torch.tensor([True, False, True, False, False, True]),
        "is_weights": 0.5 + torch.rand(6, 1, generator=g),
    }
    tokens, positive = mask.sum(), (mask * batch["is_positive"][:, None]).sum()
    # The micro-batch is a third of a step of 3 * `tokens` tokens.
    normalizers = {"tokens": 3 * tokens, "sequences": (lengths > 0).sum(), "positive_tokens": positive}
    settings = dict(epsilon_low=0.2, epsilon_high=0.28, loss_type="token", nll_coef=0.1, vf_coef=0.5)
    settings.update(cliprange_value=0.2, normalizers=normalizers, entropy_coef=0.3)
    top = (torch.rand(mask.shape, generator=g) > 0.6).float()
    drifted = (torch.rand(mask.shape, generator=g) > 0.3).float()
    entropy = torch.rand(mask.shape, generator=g).requires_grad_()
    loss, stats = vapo_loss(
        logprobs, values, batch, entropy=entropy, entropy_mask=top, off_policy_mask=drifted, **settings
    )

    ratio = torch.exp(logprobs - batch["old_logprobs"])
    ppo, bonus_sum, bonus_tokens = 0.0, 0.0, 0
    for i in range(6):
        for t in range(int(lengths[i])):
            a, r = advantages[i, t], ratio[i, t]
            token = -min(r * a, r.clamp(0.8, 1.28) * a) * batch["is_weights"][i, 0] * top[i, t] * drifted[i, t]
            ppo += token / (3 * tokens)  # a masked token still counts in the mean's denominator
            if top[i, t]:  # the bonus: over the top-entropy tokens, whatever the off-policy mask says
                bonus_sum, bonus_tokens = bonus_sum + entropy[i, t], bonus_tokens + 1
    bonus = (tokens / (3 * tokens)) * bonus_sum / bonus_tokens  # this micro-batch's share of the step's mean
    v, _ = value_loss(values, values, batch["returns"], mask, 0.2, 3 * tokens)
    nll = positive_nll_loss(logprobs, mask, batch["is_positive"])  # every positive token: no mask is the NLL's
    assert stats["loss/policy"].item() == pytest.approx(ppo.item(), rel=1e-5)
    assert stats["loss/entropy_bonus"].item() == pytest.approx(bonus.item(), rel=1e-5)
    assert loss.item() == pytest.approx((0.5 * v + ppo + 0.1 * nll - 0.3 * bonus).item(), rel=1e-5)
    loss.backward()
    torch.testing.assert_close(entropy.grad, -0.3 / 3 * mask * top / (mask * top).sum())


# ---------------------------------------------------------------------------------------------------------------------
# property-based: any shape, any right-padded mask
# ---------------------------------------------------------------------------------------------------------------------


@st.composite
def padded_batches(draw):
    batch = draw(st.integers(1, 6))
    steps = draw(st.integers(1, 12))
    lengths = torch.tensor(draw(st.lists(st.integers(0, steps), min_size=batch, max_size=batch)))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    mask = mask_from_lengths(lengths, steps)
    return lengths, mask, torch.randn(batch, steps, generator=g), torch.randn(batch, steps, generator=g), g


@settings(max_examples=60, deadline=None)
@given(padded_batches(), st.floats(0.5, 1.0), st.floats(0.0, 1.0))
def test_property_gae_shapes_padding_and_reference(data, gamma, lam):
    lengths, mask, rewards, values, _ = data
    advantages, returns = compute_gae(rewards, values, mask, gamma, lam)
    assert advantages.shape == rewards.shape and returns.shape == rewards.shape
    assert torch.all(advantages[mask == 0] == 0) and torch.all(returns[mask == 0] == 0)
    assert torch.isfinite(advantages).all() and torch.isfinite(returns).all()
    ref_adv, ref_ret = naive_gae(rewards, values, lengths, gamma, [lam] * len(lengths))
    torch.testing.assert_close(advantages.double(), ref_adv, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(returns.double(), ref_ret, rtol=1e-4, atol=1e-4)


@settings(max_examples=60, deadline=None)
@given(padded_batches(), st.sampled_from(["token", "sequence"]))
def test_property_losses_are_finite_scalars_that_ignore_padding(data, loss_type):
    lengths, mask, advantages, old, g = data
    logprobs = old + 0.5 * torch.randn(old.shape, generator=g)
    loss, stats = policy_loss(logprobs, old, advantages, mask, 0.2, 0.28, loss_type)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert all(torch.isfinite(v) for v in stats.values())
    scrambled, _ = policy_loss(scramble_padding(logprobs, mask), old, advantages, mask, 0.2, 0.28, loss_type)
    assert torch.equal(loss, scrambled)
    if mask.sum() > 0:
        assert loss.item() == pytest.approx(
            naive_policy_loss(logprobs, old, advantages, lengths, 0.2, 0.28, loss_type), rel=1e-4, abs=1e-5
        )
    else:
        assert loss.item() == 0.0
    v_loss, _ = value_loss(logprobs, old, advantages, mask, 0.2)
    assert v_loss.ndim == 0 and torch.isfinite(v_loss)
    nll = positive_nll_loss(logprobs, mask, torch.rand(mask.shape[0], generator=g) > 0.5)
    assert nll.ndim == 0 and torch.isfinite(nll)
    whitened = masked_whiten(advantages, mask)
    assert torch.isfinite(whitened).all() and torch.all(whitened[mask == 0] == 0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=20), st.floats(0.001, 1.0))
def test_property_length_adaptive_lambda_is_monotone_in_length(lengths, alpha):
    lengths = torch.tensor(sorted(lengths))
    lam = length_adaptive_lambda(lengths, alpha)
    assert torch.all((lam >= 0) & (lam <= 1))
    assert torch.all(lam[1:] >= lam[:-1])


# ---------------------------------------------------------------------------------------------------------------------
# Token log-probs and entropy from logits, in chunks
# ---------------------------------------------------------------------------------------------------------------------


def naive_logprobs_and_entropy(logits, index, temperature):
    """Per position, in float64, straight from the definitions."""
    out_logprobs = torch.zeros(index.shape, dtype=torch.float64)
    out_entropy = torch.zeros_like(out_logprobs)
    for b in range(index.shape[0]):
        for t in range(index.shape[1]):
            z = logits[b, t].double() / temperature
            log_p = z - torch.logsumexp(z, 0)
            out_logprobs[b, t] = log_p[index[b, t]]
            out_entropy[b, t] = -(log_p.exp() * log_p).sum()
    return out_logprobs, out_entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_and_entropy_match_the_definitions_in_chunks(monkeypatch, dtype, temperature):
    import trl_vapo.core as core

    monkeypatch.setattr(core, "LOGITS_CHUNK_ELEMENTS", 3 * 50)  # 3 positions per chunk, 5 chunks (the last short)
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 7, 50, generator=g)).to(dtype).requires_grad_()
    index = torch.randint(0, 50, (2, 7), generator=g)
    weights = torch.randn(2, 7, generator=g)

    logprobs, entropy = token_logprobs_and_entropy(logits, index, temperature, with_entropy=True)
    (logprobs * weights).sum().backward()

    reference = logits.detach().double().requires_grad_()
    expected_logprobs, expected_entropy = naive_logprobs_and_entropy(reference, index, temperature)
    (expected_logprobs * weights.double()).sum().backward()
    assert logprobs.dtype == torch.float32 and not entropy.requires_grad
    torch.testing.assert_close(logprobs.double(), expected_logprobs.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), expected_entropy.detach(), rtol=1e-5, atol=1e-5)
    assert logits.grad.dtype == dtype  # the gradient comes back in the logits' dtype, rounded once
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(logits.grad.double(), reference.grad.to(dtype).double(), rtol=tolerance, atol=tolerance)
    assert token_logprobs_and_entropy(logits, index, temperature)[1] is None

    # An entropy bonus trains on the entropy: its gradient, dH/dz_j = -p_j (log p_j + H) / T, against autograd's.
    logits.grad, reference.grad = None, None
    logprobs, entropy = token_logprobs_and_entropy(logits, index, temperature, True, entropy_grad=True)
    (logprobs * weights + entropy * weights.flip(0)).sum().backward()
    expected_logprobs, expected_entropy = naive_logprobs_and_entropy(reference, index, temperature)
    (expected_logprobs * weights.double() + expected_entropy * weights.flip(0).double()).sum().backward()
    tolerance = max(tolerance, 2e-5)  # log p_j + H: fp32 terms of ~10 that cancel
    torch.testing.assert_close(logits.grad.double(), reference.grad.to(dtype).double(), rtol=tolerance, atol=tolerance)


# ---------------------------------------------------------------------------------------------------------------------
# Token log-probs and entropy from the hidden states, through the LM head in tiles
# ---------------------------------------------------------------------------------------------------------------------


def naive_head_logprobs_and_entropy(hidden, weight, bias, index, temperature, scale=1.0, softcap=None):
    """Per position, in float64: z = c(s * (h W^T + b)) / T, then the definitions."""
    out_logprobs = torch.zeros(index.shape, dtype=torch.float64)
    out_entropy = torch.zeros_like(out_logprobs)
    for b in range(index.shape[0]):
        for t in range(index.shape[1]):
            y = scale * (weight.double() @ hidden[b, t].double() + (0 if bias is None else bias.double()))
            z = (y if softcap is None else softcap * torch.tanh(y / softcap)) / temperature
            log_p = z - torch.logsumexp(z, 0)
            out_logprobs[b, t] = log_p[index[b, t]]
            out_entropy[b, t] = -(log_p.exp() * log_p).sum()
    return out_logprobs, out_entropy


def sliced_and_transposed(batch, length, hidden_size, vocab, dtype, generator):
    """Inputs laid out as a model hands them over: the hidden states a slice of a longer sequence (not contiguous),
    the head's weight the transpose of an ``[H, V]`` tensor (column-major)."""
    states = torch.randn(batch, length + 2, hidden_size, generator=generator).to(dtype)
    hidden = states[:, 1:-1, :].detach().requires_grad_()
    weight_t = (torch.randn(hidden_size, vocab, generator=generator) / hidden_size**0.5).to(dtype)
    weight = weight_t.t().detach().requires_grad_()
    bias = torch.randn(vocab, generator=generator).to(dtype).requires_grad_()
    index = torch.randint(0, vocab, (batch, length), generator=generator)
    return hidden, weight, bias, index


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
@pytest.mark.parametrize("transform", [{}, {"logit_scale": 0.5, "logit_softcap": 3.0}], ids=["plain", "scaled"])
def test_lm_head_logprobs_match_the_definitions_in_tiles(monkeypatch, temperature, transform):
    import trl.kernels.chunked_logprob as trl_kernel

    import trl_vapo._compat as compat
    import trl_vapo.core as core

    # 4 positions by 11 vocabulary columns per tile: 3 row tiles (the last short) by 5 column tiles (the last short).
    monkeypatch.setattr(trl_kernel, "TOKEN_CHUNK_SIZE", 4)
    monkeypatch.setattr(compat, "TOKEN_TILE_ROWS", 4)
    monkeypatch.setattr(core, "LOGITS_CHUNK_ELEMENTS", 4 * 11)
    monkeypatch.setattr(core, "TORCH_FOLD_TILE_ELEMENTS", 4 * 11)  # (the CPU's budget)
    g = torch.Generator().manual_seed(0)
    hidden, weight, bias, index = sliced_and_transposed(2, 5, 8, 50, torch.float32, g)
    assert not hidden.is_contiguous() and not weight.is_contiguous()
    weights = torch.randn(2, 5, generator=g)

    logprobs, entropy = lm_head_logprobs_and_entropy(
        hidden, weight, bias, index, temperature, with_entropy=True, **transform
    )
    (logprobs * weights).sum().backward()

    reference = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    scale, softcap = transform.get("logit_scale", 1.0), transform.get("logit_softcap")
    expected_logprobs, expected_entropy = naive_head_logprobs_and_entropy(
        *reference, index, temperature, scale, softcap
    )
    (expected_logprobs * weights.double()).sum().backward()
    assert logprobs.shape == entropy.shape == index.shape and logprobs.dtype == torch.float32
    assert not entropy.requires_grad
    torch.testing.assert_close(logprobs.double(), expected_logprobs.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), expected_entropy.detach(), rtol=1e-5, atol=1e-5)
    for ours, theirs in zip((hidden, weight, bias), reference):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-5, atol=1e-5)
    assert lm_head_logprobs_and_entropy(hidden, weight, None, index, temperature)[1] is None

    # An entropy bonus trains on the entropy: its gradient through the tiles, against autograd's of the definition.
    for tensor in (hidden, weight, bias, *reference):
        tensor.grad = None
    logprobs, entropy = lm_head_logprobs_and_entropy(
        hidden, weight, bias, index, temperature, with_entropy=True, entropy_grad=True, **transform
    )
    (logprobs * weights + entropy * weights.flip(0)).sum().backward()
    expected_logprobs, expected_entropy = naive_head_logprobs_and_entropy(
        *reference, index, temperature, scale, softcap
    )
    (expected_logprobs * weights.double() + expected_entropy * weights.flip(0).double()).sum().backward()
    for ours, theirs in zip((hidden, weight, bias), reference):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_lm_head_logprobs_equal_the_plain_computation_to_float32_round_off(temperature):
    """Against what a model's forward and ``log_softmax`` give on the full ``[B, T, V]`` logits, in float32 at a
    Qwen-like logit spread: the same numbers and gradients but for float32 rounding."""
    g = torch.Generator().manual_seed(1)
    hidden, weight, _, index = sliced_and_transposed(3, 17, 32, 3000, torch.float32, g)
    hidden.data.mul_(4)
    weights = torch.randn(3, 17, generator=g)
    logprobs, entropy = lm_head_logprobs_and_entropy(hidden, weight, None, index, temperature, with_entropy=True)
    (logprobs * weights).sum().backward()

    plain_hidden, plain_weight = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    log_p = torch.nn.functional.linear(plain_hidden, plain_weight).div(temperature).log_softmax(-1)
    plain = log_p.gather(-1, index[..., None]).squeeze(-1)
    (plain * weights).sum().backward()
    torch.testing.assert_close(logprobs, plain, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, -(log_p.exp() * log_p).sum(-1).detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(hidden.grad, plain_hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, plain_weight.grad, rtol=1e-5, atol=1e-6)


def test_lm_head_logprobs_in_bfloat16_round_only_the_logits():
    """bf16 inputs (a bf16 model, or autocast): the tiles are bf16 as the model's own logits would be, every sum in
    float32."""
    g = torch.Generator().manual_seed(2)
    hidden, weight, bias, index = sliced_and_transposed(2, 6, 16, 300, torch.bfloat16, g)
    logprobs, _ = lm_head_logprobs_and_entropy(hidden, weight, bias, index, 0.7)
    logprobs.sum().backward()
    logits = torch.nn.functional.linear(hidden.detach(), weight.detach(), bias.detach())  # bf16, as the model's
    expected = (logits.double() / 0.7).log_softmax(-1).gather(-1, index[..., None]).squeeze(-1)
    torch.testing.assert_close(logprobs.double(), expected, rtol=0, atol=1e-4)
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16


def test_lm_head_logprobs_build_no_vocabulary_sized_tensor():
    """What autograd keeps from the forward: the inputs and a few floats per position, nothing of size V."""
    g = torch.Generator().manual_seed(3)
    hidden, weight, bias, index = sliced_and_transposed(4, 64, 16, 4000, torch.float32, g)
    largest = []

    def pack(tensor):
        if tensor.data_ptr() not in (hidden.data_ptr(), weight.data_ptr(), bias.data_ptr()):
            largest.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        lm_head_logprobs_and_entropy(hidden, weight, bias, index, with_entropy=True)
    assert max(largest) <= 4 * 64 * 16  # the flattened hidden states at most; the logits would be 4 * 64 * 4000


@pytest.mark.parametrize(("positions", "vocab"), [(12, 97), (1, 151936), (5000, 151936)])
def test_lm_head_tiles_are_never_larger_than_the_logits_or_the_budget(monkeypatch, positions, vocab):
    """The tile buffer (positions by columns): at most the logits themselves, at most ``LOGITS_CHUNK_ELEMENTS``; on
    the CPU, where TRL's kernel folds a tile with float32 temporaries several times its size, at most
    ``TORCH_FOLD_TILE_ELEMENTS``."""
    import trl_vapo._compat as compat
    import trl_vapo.core as core

    tiles, kernel = [], compat.TiledLogProbs

    class Recorded(Exception):
        """Raised once the tile is recorded: the 5000 x 151,936 logits themselves are not this test's concern."""

    class Recording(kernel):
        @staticmethod
        def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, *rest):
            tiles.append(min(hidden.shape[0], compat.TOKEN_TILE_ROWS) * chunk_size)
            raise Recorded

    monkeypatch.setattr(compat, "TiledLogProbs", Recording)
    hidden, weight = torch.randn(positions, 4), torch.randn(vocab, 4)
    with pytest.raises(Recorded):
        lm_head_logprobs_and_entropy(hidden, weight, None, torch.randint(0, vocab, (positions,)))
    assert tiles and tiles[0] <= min(positions * vocab, core.TORCH_FOLD_TILE_ELEMENTS) < core.LOGITS_CHUNK_ELEMENTS


def test_token_logprobs_keep_only_the_logits_for_backward():
    """What autograd keeps from the forward: the logits as given plus a few floats per position, where the plain
    fp32 log-softmax keeps several vocabulary-sized fp32 copies (3.5x GRPOTrainer's peak memory at Qwen2.5 shapes)."""
    logits = torch.randn(4, 64, 1000).to(torch.bfloat16).requires_grad_()
    index = torch.randint(0, 1000, (4, 64))

    def saved_bytes(fn):
        saved = []

        def pack(tensor):
            saved.append(tensor.numel() * tensor.element_size() if tensor.data_ptr() != logits.data_ptr() else 0)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            fn()
        return sum(saved)

    per_position = 4 * 64
    ours = saved_bytes(lambda: token_logprobs_and_entropy(logits, index, with_entropy=True))
    plain = saved_bytes(lambda: logits.float().log_softmax(-1).gather(-1, index[..., None]))
    assert ours <= 16 * per_position  # the index and one logsumexp per position; the logits themselves are free
    assert plain >= 4 * logits.numel()  # at least one fp32 copy of the logits
