"""The mathematics of VAPO as small, pure tensor functions.

Every function works on right-padded ``(batch, time)`` tensors together with a ``mask`` that is 1 on valid
response tokens and 0 on padding. Nothing at a padded position (reward, value, log-probability) ever reaches an
output: padded outputs are exactly 0 and every mean runs over valid tokens only.

References:
    VAPO:   Yue et al., "VAPO: Efficient and Reliable Reinforcement Learning for Advanced Reasoning Tasks",
            arXiv 2504.05118. Section 3.1 (value pretraining, decoupled GAE), 3.2 (length-adaptive GAE,
            token-level loss), 3.3 (clip-higher, positive-example LM loss, group sampling).
    VC-PPO: Yuan et al., "What's Behind PPO's Collapse in Long-CoT? Value Optimization Holds the Secret",
            arXiv 2503.01491. Eq. 2 (clipped surrogate), Eq. 3 (GAE), Eq. 5 (value target under lambda).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .metric_names import VALUE_LOSS

AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over data-parallel ranks (e.g. ``accelerator.reduce(t, "sum")``); ``None`` means one process."""

__all__ = [
    "adaptive_entropy_coef",
    "compute_gae",
    "decoupled_gae",
    "explained_variance",
    "explained_variance_plateaued",
    "group_normalized_rewards",
    "high_entropy_mask",
    "importance_sampling_weights",
    "length_adaptive_lambda",
    "lm_head_logprobs_and_entropy",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "off_policy_mask",
    "policy_loss",
    "positive_nll_loss",
    "terminal_rewards",
    "token_logprobs_and_entropy",
    "vapo_loss",
    "value_loss",
    "vespo_weights",
]

SURROGATES = ("ppo", "cispo", "sapo", "vespo")
"""The per-token policy objectives of :func:`policy_loss`: VAPO's clipped PPO and GRPOConfig's other losses."""

NO_FLOAT64_DEVICES = frozenset({"mps"})
"""Device types without float64 tensors (Apple's MPS refuses them): :func:`exact` sums their tensors on the CPU."""


def exact_device(device: torch.device) -> torch.device:
    """Where :func:`exact` puts a tensor of ``device``: the device itself, or the CPU for one without float64."""
    return torch.device("cpu") if device.type in NO_FLOAT64_DEVICES else device


def exact(values: torch.Tensor) -> torch.Tensor:
    """``values`` in float64, for sums that must stay exact (moments, digests), on :func:`exact_device` (so an Apple
    GPU's statistics are the CPU's numbers, not float32's). The package's one door to float64."""
    return values.to(exact_device(values.device), torch.float64)


# The largest |log rho_t| taken (verl's core_algos clamps alike): one token 90 nats off would make rho = inf, the
# loss inf and the whole step skipped; clamped, the token's term is bounded (see `policy_loss`).
LOG_RATIO_LIMIT = 20.0
LOGITS_CHUNK_ELEMENTS = 1 << 24  # 64 MiB of fp32 per chunk: ~110 positions of a 152k vocabulary
# The LM head's tile where TRL's kernel folds it with whole-tile torch operations (without Triton: a CPU, an
# Apple GPU), whose float32 temporaries are several times the tile: a 2^24-logit tile held ~0.5 GiB there, above
# the plain log-softmax's peak for micro-batches under ~350 positions (CPU, 1 x 160 positions: 0.56 against 0.21 GiB).
TORCH_FOLD_TILE_ELEMENTS = 1 << 22


def _scaled_fp32(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """z = logits / T in fp32 (one pass fewer over the vocabulary at T = 1)."""
    z = logits.float()
    return z if temperature == 1.0 else z / temperature


class _TokenLogprobs(torch.autograd.Function):
    """Chunked fp32 log-softmax-and-gather whose backward recomputes the softmax instead of storing it."""

    @staticmethod
    def forward(ctx, logits, index, temperature, with_entropy):
        ctx.set_materialize_grads(False)  # an entropy only logged gets no gradient: none to compute
        vocab = logits.shape[-1]
        flat, flat_index = logits.reshape(-1, vocab), index.reshape(-1, 1)
        rows = max(1, LOGITS_CHUNK_ELEMENTS // vocab)
        logsumexp = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        logprobs = torch.empty_like(logsumexp)
        entropy = torch.empty_like(logsumexp) if with_entropy else None
        for start in range(0, flat.shape[0], rows):
            part = slice(start, start + rows)
            z = _scaled_fp32(flat[part], temperature)
            lse = torch.logsumexp(z, dim=-1)
            logsumexp[part] = lse
            logprobs[part] = z.gather(-1, flat_index[part]).squeeze(-1) - lse
            if with_entropy:  # H = logsumexp(z) - sum_j p_j z_j
                entropy[part] = lse - (torch.exp(z - lse[:, None]) * z).sum(-1)
        ctx.save_for_backward(logits, index, logsumexp, entropy if with_entropy else logsumexp)
        ctx.temperature = temperature
        shape = logits.shape[:-1]
        if with_entropy:
            return logprobs.view(shape), entropy.view(shape)
        return logprobs.view(shape), None

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, index, logsumexp, entropy = ctx.saved_tensors
        vocab, temperature = logits.shape[-1], ctx.temperature
        flat, flat_index = logits.reshape(-1, vocab), index.reshape(-1, 1)
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(logsumexp)
        grad_out = grad_logprobs.reshape(-1, 1).float() / temperature
        grad_h = None if grad_entropy is None else grad_entropy.reshape(-1, 1).float() / temperature
        grad = torch.empty_like(flat)
        rows = max(1, LOGITS_CHUNK_ELEMENTS // vocab)
        for start in range(0, flat.shape[0], rows):
            part = slice(start, start + rows)
            log_probs = _scaled_fp32(flat[part], temperature) - logsumexp[part, None]
            probs = torch.exp(log_probs)
            part_grad = -probs * grad_out[part]  # d log p_y / d x_j = (1[j = y] - p_j) / T
            part_grad.scatter_add_(-1, flat_index[part], grad_out[part])
            if grad_h is not None:  # d H / d x_j = -p_j (log p_j + H) / T
                part_grad -= grad_h[part] * probs * (log_probs + entropy.reshape(-1, 1)[part])
            grad[part] = part_grad.to(grad.dtype)
        return grad.view_as(logits), None, None, None


def lm_head_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    index: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    *,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(y_t) = z_t[y_t] - logsumexp(z_t) and H_t = -sum_j pi_j log pi_j (detached unless ``entropy_grad``: an
    entropy bonus), from the hidden states, without ever building the ``[..., V]`` logits.

    z_t = c(s * (h_t W^T + b)) / T: the LM head ``W`` (``[V, H]``), ``b`` (``[V]`` or None), the model's logit scale
    ``s`` and soft cap ``c(x) = cap * tanh(x / cap)`` (identity without one), at temperature ``T`` (the policy
    ratio of VAPO's Eq. 2 and the KL penalty are taken under the sampling distribution softmax(z_t)).

    The projection runs on tiles of at most ``LOGITS_CHUNK_ELEMENTS`` logits where TRL's kernel folds them with
    Triton, ``TORCH_FOLD_TILE_ELEMENTS`` elsewhere (``TOKEN_TILE_ROWS`` positions by as many vocabulary columns as
    fit), folded into running logsumexp statistics; backward recomputes each tile and accumulates the gradients of
    ``hidden``, ``weight`` and ``bias`` in float32. This is TRL's
    ``trl.kernels.ChunkedLogProbFunction`` (GRPOTrainer's fused LM head: Triton on CUDA, torch elsewhere), with a tile
    sized for memory rather than GEMM width: GRPOTrainer's 32,768-column tiles take 0.5-1 GB of float32
    temporaries on a CPU.

    Args:
        hidden: ``[..., H]`` the hidden states whose next token is ``index`` (any strides).
        weight, bias: the LM head's.
        index: ``[...]`` int64 token ids.
    Returns ``(logprobs, entropy)``, float32 ``[...]``; ``entropy`` is None unless ``with_entropy``.
    """
    from ._compat import TOKEN_TILE_ROWS, TiledLogProbs, tiles_fold_with_triton  # here: importing TRL costs seconds

    flat = hidden.reshape(-1, hidden.shape[-1])  # a copy of [N, H] at most, never of anything vocabulary-sized
    rows = max(1, min(flat.shape[0], TOKEN_TILE_ROWS))
    # (TRL's kernel decides the fold: Triton on CUDA and XPU where Triton is installed, torch elsewhere)
    budget = LOGITS_CHUNK_ELEMENTS if tiles_fold_with_triton(flat.device) else TORCH_FOLD_TILE_ELEMENTS
    columns = max(1, min(weight.shape[0], budget // rows))  # the tile buffer: rows x columns
    outputs = ("log_probs", "entropy") if with_entropy or entropy_grad else ("log_probs",)
    logprobs, entropy, *_ = TiledLogProbs.apply(
        flat, weight, bias, index.reshape(-1), float(temperature), columns, logit_softcap, logit_scale, outputs
    )
    shape = index.shape
    if entropy is not None and not entropy_grad:
        entropy = entropy.detach()
    return logprobs.view(shape), None if entropy is None else entropy.view(shape)


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    index: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(y_t) = z_t[y_t] - logsumexp(z_t), z_t = logits_t / T, and H_t = -sum_j pi_j log pi_j (detached unless
    ``entropy_grad``: an entropy bonus's gradient dH/dz_j = -pi_j (log pi_j + H)).

    Exact fp32 maths on logits of any dtype, at a fraction of the memory of ``logits.float().log_softmax(-1)``:
    the vocabulary-sized work runs in chunks of positions, and backward keeps only the logits as given (bf16 under
    autocast) and one logsumexp per position, recomputing the softmax chunk by chunk. Materialising ``[B, T, V]``
    in fp32 for the forward and again for the gradient is what made a Qwen2.5-sized vocabulary (152k) cost 3.5x
    GRPOTrainer's peak memory; TRL's ``selective_log_softmax`` and fused kernels avoid it the same way.

    Args:
        logits: ``[..., V]`` the scores that predict ``index``.
        index: ``[...]`` int64 token ids.
    Returns ``(logprobs, entropy)``, fp32 ``[...]``; ``entropy`` is None unless ``with_entropy``.
    """
    logprobs, entropy = _TokenLogprobs.apply(logits, index, float(temperature), with_entropy or entropy_grad)
    return logprobs, None if entropy is None else entropy if entropy_grad else entropy.detach()


IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    dim: int | None = None,
    all_reduce: AllReduce | None = None,
    empty: float = 0.0,
) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1: ``sum(x * m) / sum(m)``.

    With ``dim=None`` the mean runs over every valid element, pooled over processes with ``all_reduce`` (the sum and
    the count, one call); otherwise along ``dim``. Where no element is valid, ``empty``: 0 (a loss term of nothing),
    or NaN for a reading of nothing. Padded entries may hold anything, even NaN or inf: they are selected away, not
    multiplied by zero.
    """
    mask = mask.to(values.dtype)
    selected = torch.where(mask.bool(), values, torch.zeros_like(values))
    if dim is not None:
        if all_reduce is not None:
            raise ValueError("masked_mean pools over processes only the mean of every element (dim=None).")
        count = mask.sum(dim)
        mean = selected.sum(dim) / count.clamp(min=1)  # (0 where the count is: `empty`'s default)
        return mean if empty == 0 else torch.where(count > 0, mean, empty)
    sums = torch.stack([selected.sum(), mask.sum()])
    if all_reduce is not None:
        sums = all_reduce(sums)
    mean = sums[0] / sums[1].clamp(min=1)
    return mean if empty == 0 else torch.where(sums[1] > 0, mean, empty)


def _masked_moments(
    values: torch.Tensor, mask: torch.Tensor, all_reduce: AllReduce | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, population variance, count) over valid elements, pooled over ranks when ``all_reduce`` is given.

    Two passes, each one all-reduce: the count and the sum, then the squares about the pooled mean. In float64. One
    pass of ``E[x^2] - E[x]^2`` rounds to a few ulps of ``x^2`` where every value is one constant (``0.1f^2`` summed
    over thousands of tokens): a "variance" of 1e-18 that made the explained variance -1e15 rather than NaN.
    """
    valid = mask.bool()
    selected = exact(torch.where(valid, values, torch.zeros_like(values)))
    valid = valid.to(selected.device)  # on the CPU with them for a device without float64 (`exact`)
    sums = torch.stack([exact(valid.sum()), selected.sum()])
    if all_reduce is not None:
        sums = all_reduce(sums)
    count, total = sums.unbind()
    n = count.clamp(min=1)
    mean = total / n
    centered = torch.where(valid, selected - mean, torch.zeros_like(selected))
    squares = (centered * centered).sum()
    if all_reduce is not None:
        squares = all_reduce(squares)
    var = squares / n
    return mean.to(values.device, values.dtype), var.to(values.device, values.dtype), count


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over valid elements.

    ``unbiased=True`` applies Bessel's correction ``n / (n - 1)`` (skipped when n < 2, which gives 0).
    """
    _, var, count = _masked_moments(values, mask)
    if unbiased and count >= 2:
        var = var * (count / (count - 1)).to(var.dtype)
    return var


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    all_reduce: AllReduce | None = None,
) -> torch.Tensor:
    """Normalise ``values`` to unit variance (and zero mean if ``shift_mean``) using valid elements only.

        whitened = (x - mean) / sqrt(var + eps)          (shift_mean=True)
        whitened = (x - mean) / sqrt(var + eps) + mean   (shift_mean=False: rescale, keep the mean)

    ``mean`` and the unbiased ``var`` are taken over every valid token of the batch; pass ``all_reduce`` to take
    them over all data-parallel ranks (the spec: whitening statistics span the whole batch on all ranks).
    Padded outputs are 0.
    """
    mean, var, count = _masked_moments(values, mask, all_reduce)
    if count >= 2:
        var = var * (count / (count - 1)).to(var.dtype)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def length_adaptive_lambda(lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-sequence GAE lambda for the policy (VAPO §3.2, length-adaptive GAE).

    The paper asks the GAE weights to sum to a length-proportional horizon,
    ``sum_t lambda^t = 1/(1-lambda) = alpha*l``, which gives

        lambda_i = clamp(1 - 1 / (alpha * l_i), 0, 1)

    so long responses (large ``l_i``) keep lambda near 1 and propagate the terminal reward far back, while short
    ones get a smaller lambda and lower variance. With the paper's ``alpha = 0.05``: ``l = 20`` gives 0,
    ``l = 100`` gives 0.8, ``l = 1000`` gives 0.98.

    Args:
        lengths: ``[B]`` number of valid response tokens per sequence.
        alpha: the paper's alpha (> 0).

    Returns:
        ``[B]`` float tensor of lambdas in ``[0, 1]``.
    """
    if alpha <= 0:
        raise ValueError(f"length_adaptive_alpha must be > 0, got {alpha}")
    lengths = lengths.to(torch.float32)
    # A zero length would divide by zero; 1 - inf clamps to lambda = 0, which is also the limit for short sequences.
    lam = 1.0 - 1.0 / (alpha * lengths)
    return torch.nan_to_num(lam, nan=0.0, neginf=0.0).clamp(0.0, 1.0)


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation on padded sequences (VC-PPO Eq. 3 and Eq. 5; VAPO §3.1-3.2).

        delta_t = r_t + gamma * V(s_{t+1}) - V(s_t),      V(s_T) = 0 after the last valid token
        A_t     = sum_{l=0}^{T-t-1} (gamma * lambda)^l * delta_{t+l}
        G_t     = A_t + V(s_t)                           (the critic's regression target)

    ``lam`` is a float or a per-sequence tensor ``[B]`` (length-adaptive lambda). Decoupled GAE calls this twice:
    once with ``lam_actor`` for the policy's advantages, once with ``lam_critic = 1`` for the critic's targets.
    With ``gamma = lam = 1``, ``G_t`` is the plain reward-to-go and does not depend on ``values`` at all.

    Nothing leaks from padding: rewards and values at padded positions are ignored, the value after a sequence's
    last valid token is 0 (no bootstrap from a pad position), and padded outputs are 0.

    A mask may have holes: tokens inside a completion that the policy did not sample (an environment's reply in a
    multi-turn rollout, a `rollout_func`'s `env_mask`). They are not actions, so t runs over each sequence's valid
    tokens only: s_{t+1} is the state at the next valid token, whatever tokens lie between.

    Args:
        rewards: ``[B, T]`` per-token rewards (the verifier's score sits on each sequence's last valid token).
        values: ``[B, T]`` critic values V(s_t).
        mask: ``[B, T]`` 1 for valid response tokens (right-padded, maybe with holes).
        gamma: discount factor.
        lam: GAE lambda, a float or a ``[B]`` tensor.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` (float32 or the inputs' dtype, whichever is wider).
    """
    valid = mask.bool()
    # Each row's valid tokens moved to its front, in order, so that holes become trailing padding; a right-padded
    # mask has none, and its order is the identity. The results are put back where the tokens were.
    order = torch.argsort((~valid).to(torch.uint8), dim=1, stable=True)
    advantages, returns = _gae_right_padded(
        rewards.gather(1, order), values.gather(1, order), valid.gather(1, order), gamma, lam
    )
    return tuple(torch.empty_like(x).scatter_(1, order, x) for x in (advantages, returns))


def _gae_right_padded(
    rewards: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, gamma: float, lam: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`compute_gae` on a right-padded mask (`valid`, bool): a prefix of each row."""
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    rewards = torch.where(valid, rewards.to(dtype), torch.zeros((), dtype=dtype, device=rewards.device))
    values = torch.where(valid, values.to(dtype), torch.zeros((), dtype=dtype, device=values.device))
    m = valid.to(dtype)
    reward_to_go = None
    if gamma == 1.0:
        # Undiscounted (VAPO's gamma), the reward-to-go is a reverse cumulative sum, not a loop over the tokens (on a
        # GPU, kernel launches at every token of every rollout); with lambda 1 (the critic's targets) nothing is left
        # to loop over.
        reward_to_go = rewards.flip(1).cumsum(1).flip(1) * m  # (0 past each row's end: its rewards are 0 there)
        if not isinstance(lam, torch.Tensor) and float(lam) == 1.0:
            return (reward_to_go - values) * m, reward_to_go
    batch, steps = rewards.shape
    if isinstance(lam, torch.Tensor):
        lam = lam.to(device=rewards.device, dtype=dtype).reshape(batch)
    else:
        lam = torch.full((batch,), float(lam), device=rewards.device, dtype=dtype)
    decay = gamma * lam

    # V(s_{t+1}) is zero wherever t+1 is padding or past the end: `values` is already zero there.
    next_values = torch.cat([values[:, 1:], values.new_zeros(batch, 1)], dim=1)
    deltas = (rewards + gamma * next_values - values) * m

    advantages = torch.zeros_like(deltas)
    running_advantage = deltas.new_zeros(batch)
    discounted = reward_to_go is None
    if discounted:
        reward_to_go, running_return = torch.zeros_like(deltas), deltas.new_zeros(batch)
    for t in reversed(range(steps)):
        running_advantage = (deltas[:, t] + decay * running_advantage) * m[:, t]
        advantages[:, t] = running_advantage
        if discounted:
            running_return = (rewards[:, t] + gamma * running_return) * m[:, t]
            reward_to_go[:, t] = running_return
    # lambda = 1 telescopes to the Monte-Carlo return (VC-PPO Eq. 5): use it directly, so the critic target is
    # exactly the reward-to-go rather than reward-to-go plus rounding error from the values.
    unit_lambda = (lam == 1.0).reshape(batch, 1)
    advantages = torch.where(unit_lambda, (reward_to_go - values) * m, advantages)
    returns = torch.where(unit_lambda, reward_to_go, (advantages + values) * m)
    return advantages, returns


def last_valid_position(mask: torch.Tensor) -> torch.Tensor:
    """[B] the position of each row's last valid token in `mask` [B, T] (holes allowed), -1 for a row without one."""
    # The maximum of position + 1 over valid tokens (0 elsewhere), so that no row is all negative: torch 2.13's MPS
    # kernel read 0 for the int64 maximum of a row of negative numbers.
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask.bool() * positions).amax(dim=1) - 1


def terminal_rewards(sequence_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards with each sequence's verifier score on its last valid token (VAPO / VC-PPO: sparse reward).

        r_{i,t} = R_i  if t = last_i,  else 0          last_i = the position of sequence i's last valid token

    Never on the first pad after the sequence, nor on a token a hole in the mask leaves out (see `compute_gae`);
    a sequence without valid tokens gets nothing.
    """
    last = last_valid_position(mask)
    rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards[rows, last.clamp(min=0)] = torch.where(last >= 0, sequence_rewards.float(), 0.0)
    return rewards


def decoupled_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam_actor: float,
    lam_critic: float,
    length_adaptive_alpha: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decoupled, length-adaptive GAE (VAPO §3.1-3.2, VC-PPO §4): the actor's advantages and the critic's targets
    from two lambdas.

        lambda_i  = clamp(1 - 1 / (alpha * l_i), 0, 1)     length-adaptive (alpha given), else lam_actor
        A         = GAE(rewards, values; gamma, lambda_i)            the policy's advantages
        G         = GAE(rewards, values; gamma, lam_critic) + V      the critic's regression targets

    `lam_critic = 1` makes G the Monte-Carlo return (unbiased, independent of V); a `lambda_i < 1` lowers the
    variance of A. Returns ``(advantages, returns, lambda_actor)``, the last one per sequence ``[B]``.
    """
    lengths = mask.sum(dim=1)
    if length_adaptive_alpha is not None:
        lambda_actor = length_adaptive_lambda(lengths, length_adaptive_alpha)
    else:
        lambda_actor = torch.full(lengths.shape, float(lam_actor))
    lambda_actor = lambda_actor.to(rewards.device)
    advantages, _ = compute_gae(rewards, values, mask, gamma, lambda_actor)
    _, returns = compute_gae(rewards, values, mask, gamma, lam_critic)
    return advantages, returns, lambda_actor


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str = "token",
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """How per-token losses become the loss (verl's ``agg_loss``): kept apart from what each token's loss is.

        "token":    L = sum_{(i,t) in M} l_{i,t} / N,        N = |M|                      (VAPO §3.2, Eq. 8)
        "sequence": L = sum_i (sum_t l_{i,t} / |o_i|) / N,  N = sequences with a token    (vanilla PPO)
        "luspo":    L = sum_{(i,t) in M} l_{i,t} / N,        N = sequences with a token    (LUSPO)

    ``per_token`` (``[B, T]``) is 0 outside ``mask``. ``normalizer`` replaces N: the count of the whole optimizer
    step over micro-batches and ranks (divided by the world size where gradients are averaged), so that the losses of
    the step's micro-batches sum to the full-batch mean.
    """
    if loss_type not in ("token", "sequence", "luspo"):
        raise ValueError(f"loss_type must be 'token', 'sequence' or 'luspo', got {loss_type!r}")
    valid = mask.bool()
    if normalizer is None:
        normalizer = (valid.sum() if loss_type == "token" else valid.any(dim=1).sum()).clamp(min=1)
    if loss_type == "sequence":
        return (per_token.sum(dim=1) / valid.sum(dim=1).clamp(min=1)).sum() / normalizer
    return per_token.sum() / normalizer


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    loss_type: str = "token",
    normalizer: float | torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    surrogate: str = "ppo",
    is_weights: torch.Tensor | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_shape: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate with asymmetric (clip-higher) clipping (VC-PPO Eq. 2; VAPO §3.2-3.3).

        rho_t    = exp(clip(logprob_t - old_logprob_t, -20, 20))
        l_t      = -min(min(rho_t, delta) * A_t, clip(rho_t, 1 - epsilon_low, 1 + epsilon_high) * A_t)

    The log-ratio's clip (``LOG_RATIO_LIMIT``, verl's) changes nothing within e^20 of the sampler; beyond, the token
    adds a bounded term, where rho = inf would make the loss inf and skip the whole step. Under ``"ppo"`` and
    ``"sapo"`` that term carries no gradient (its ratio is the clip's constant; with A_t < 0 its value, e^20 |A_t|,
    still weighs in the logged loss); under ``"cispo"`` and ``"vespo"`` the gradient is log pi's, weighted by the
    clipped ratio.

    ``delta`` (None: no cap; not in VAPO; ``"ppo"`` only) is two-sided clipping (INTELLECT-2; GRPOConfig's
    ``delta``): with A_t < 0 the unclipped term -rho_t A_t grows without bound as rho_t does, and the cap bounds it
    at -delta A_t. With delta > 1 + epsilon_high it changes nothing where A_t > 0 (the clipped term is the smaller
    there).

    ``importance_sampling_level="sequence"`` (not in VAPO; GRPOConfig's GSPO setting) takes GSPO-token's ratio (GSPO
    Eq. 13-14), which keeps VAPO's per-token advantages: rho_t = sg[s_i] * pi(y_t) / sg[pi(y_t)] with
    s_i = exp(mean_t (logprob_t - old_logprob_t)): its value is the sequence's ratio s_i at every token (clipped as
    one), its gradient s_i * grad log pi(y_t).

        "token":    L = sum_{(i,t) in M} l_{i,t} / |M|                   (VAPO: every token weighs the same)
        "sequence": L = mean_i( sum_t l_{i,t} / |o_i| )                 (vanilla PPO: every sequence weighs the same)
        "luspo":    L = mean_i( sum_t l_{i,t} )                          (LUSPO, GRPOConfig's: a sequence weighs
                                                                        by its length, not normalised by it)

    In ``"token"`` mode a token of a 10-token response and a token of a 1000-token response weigh the same; in
    ``"sequence"`` mode the short response's tokens weigh 100 times more.

    ``normalizer`` replaces the denominator so that one optimisation step spread over micro-batches and ranks still
    gets one mean: for ``"token"`` pass the number of valid tokens of the whole step (divided by the world size when
    gradients are averaged over ranks); for ``"sequence"`` and ``"luspo"`` the number of sequences likewise.
    Summing the losses of the step's micro-batches then gives exactly the full-batch mean.

    ``surrogate`` (not in VAPO, whose Eq. 8 is ``"ppo"``; GRPOConfig's other losses, each on VAPO's per-token
    advantages A_t; sg[.] stops the gradient):

        "cispo": l_t = -sg[min(rho_t, epsilon_high)] * A_t * logprob_t      (MiniMax-M1 Eq. 4: the weight is clipped,
                 never the gradient; ``epsilon_high`` is the weight's cap eps_max itself, as GRPOTrainer reads it)
        "sapo":  l_t = -(4 / tau_t) * sigmoid(tau_t * (rho_t - 1)) * A_t     (SAPO, arXiv 2511.20347: a soft gate for
                 hard clipping; tau_t = ``sapo_temperature_pos`` where A_t > 0, else ``sapo_temperature_neg``)
        "vespo": l_t = -sg[phi(w_i)] * A_t * logprob_t,  phi(w) = exp(lam + k log w - lam w)   (VESPO: phi(1) = 1)
                 w_i = exp(clip(sum_t clip(log rho_t) + sum_t log is_t)), the sequence's ratio to the sampler,
                 (k, lam) = ``vespo_shape``[0:2] where A_t >= 0, else [2:4]  (GRPOConfig's vespo_k_pos,
                 vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)

    ``is_weights`` (``[B, T]`` or ``[B, 1]``, no gradient; :func:`importance_sampling_weights`) correct for
    completions sampled by another engine: they multiply ``l_t`` before the mean, except under ``"vespo"``, whose
    w_i takes them in (as GRPOTrainer does). ``weights`` (the same shapes, no gradient) multiply ``l_t`` too: the
    token masks of :func:`vapo_loss`.

    Returns:
        ``(loss, stats)`` where ``stats`` holds detached means over this call's valid tokens: ``approx_kl``
        (``E[(rho - 1) - log rho]``) and ``ratio`` (mean rho); under ``"ppo"`` ``clip_frac_low`` (negative
        advantage, ratio clipped at ``1 - epsilon_low``), ``clip_frac_high`` (positive advantage, ratio clipped at
        ``1 + epsilon_high``) and ``clip_frac`` (either), and over the sequences with a valid token the smallest
        share of a sequence's tokens clipped low, ``clip_frac_low_min`` (1 without one), and the largest clipped
        high, ``clip_frac_high_max`` (0 without one); under ``"cispo"`` ``clip_frac_high`` (positive advantage,
        weight capped at ``epsilon_high``); under ``"vespo"`` ``phi`` (the mean over those sequences of each one's
        mean weight phi_t).
    """
    if loss_type not in ("token", "sequence", "luspo"):
        raise ValueError(f"loss_type must be 'token', 'sequence' or 'luspo', got {loss_type!r}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    if surrogate not in SURROGATES:
        raise ValueError(f"surrogate must be one of {', '.join(map(repr, SURROGATES))}, got {surrogate!r}")
    valid = mask.bool()
    zeros = torch.zeros_like(logprobs)
    clamped = (logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    token_log_ratio = log_ratio = torch.where(valid, clamped, zeros)
    if importance_sampling_level == "sequence":
        sequence = (log_ratio.sum(dim=1) / valid.sum(dim=1).clamp(min=1)).detach()[:, None]
        log_ratio = torch.where(valid, sequence + logprobs - logprobs.detach(), zeros)
    ratio = torch.exp(log_ratio)
    advantages = torch.where(valid, advantages.to(logprobs.dtype), zeros)
    stats = {}
    if surrogate == "ppo":
        unclipped = -advantages * (ratio if delta is None else torch.clamp(ratio, max=delta))
        clipped = -advantages * torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
        per_token = torch.maximum(unclipped, clipped)
        with torch.no_grad():
            high = (advantages > 0) & (ratio > 1.0 + epsilon_high)
            low = (advantages < 0) & (ratio < 1.0 - epsilon_low)
            stats["clip_frac_low"] = masked_mean(low.float(), mask)
            stats["clip_frac_high"] = masked_mean(high.float(), mask)
            stats["clip_frac"] = masked_mean((low | high).float(), mask)
            # GRPOTrainer's extremes over the sequences (those with a valid token) of each one's clipped share; a
            # share lies in [0, 1], so 1 and 0 are the minimum's and the maximum's neutral values (no sequence)
            scored = valid.any(dim=1)
            low_share, high_share = masked_mean(low.float(), mask, dim=1), masked_mean(high.float(), mask, dim=1)
            stats["clip_frac_low_min"] = torch.where(scored, low_share, 1.0).amin()
            stats["clip_frac_high_max"] = torch.where(scored, high_share, 0.0).amax()
    elif surrogate == "cispo":
        per_token = -torch.clamp(ratio, max=epsilon_high).detach() * advantages * logprobs
        with torch.no_grad():
            stats["clip_frac_high"] = masked_mean(((advantages > 0) & (ratio > epsilon_high)).float(), mask)
    elif surrogate == "sapo":
        tau = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg).to(ratio.dtype)
        per_token = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * advantages
    else:  # "vespo"
        phi = vespo_weights(token_log_ratio, advantages, valid, is_weights, *vespo_shape)
        per_token = -phi * advantages * logprobs
        # GRPOTrainer's `phi_seq_mean`: a mean over the sequences with a valid token of each one's mean phi (one
        # value per sequence where the advantage is, per token where GAE gives each token its own sign)
        per_sequence = masked_mean(phi.expand_as(per_token), mask, dim=1)
        stats["phi"] = masked_mean(per_sequence, valid.any(dim=1).float())
    per_token = torch.where(valid, per_token, zeros)
    if is_weights is not None and surrogate != "vespo":
        per_token = per_token * is_weights.to(per_token.dtype)
    if weights is not None:
        per_token = per_token * weights.to(per_token.dtype)

    loss = aggregate_loss(per_token, valid, loss_type, normalizer)

    with torch.no_grad():
        stats["approx_kl"] = masked_mean(token_log_ratio.exp() - 1.0 - token_log_ratio, mask)
        stats["ratio"] = masked_mean(ratio, mask)
    return loss, stats


@torch.no_grad()
def vespo_weights(
    token_log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    is_weights: torch.Tensor | None,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
) -> torch.Tensor:
    """VESPO's gamma weight of each sequence, per token by its advantage's sign (no gradient; ``policy_loss``):

        log w_i = clip( sum_t clip(log rho_t, -20, 20) + sum_t clip(log is_t, log 1e-8, 20),  log 1e-8, 20 )
        phi_t   = exp(lam_t + k_t * log w_i - lam_t * w_i),   (k_t, lam_t) = (k_pos, lambda_pos) where A_t >= 0,
                                                                              else (k_neg, lambda_neg)

    phi(1) = 1: on-policy, the update is the policy gradient's; a sequence far from the sampler (w << 1 or w >> 1)
    weighs little. ``token_log_ratio`` is 0 outside ``mask``; ``is_weights`` the vLLM correction's ratios, per token
    (``[B, T]``; a 0 from its masking mode is clipped to 1e-8) or per sequence (``[B, 1]``, added once). Non-finite
    weights are 0, as GRPOTrainer's.
    """
    valid = mask.bool()
    log_w = torch.where(valid, token_log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT), 0.0).sum(dim=1, keepdim=True)
    if is_weights is not None:
        log_is = torch.log(is_weights.to(log_w.dtype)).clamp(math.log(1e-8), 20.0)
        if log_is.shape[1] == 1:  # a sequence-level mode's ratio: the sequence's once
            log_w = log_w + log_is
        else:
            log_w = log_w + torch.where(valid, log_is, 0.0).sum(dim=1, keepdim=True)
    log_w = log_w.clamp(math.log(1e-8), 20.0)
    nonnegative = advantages >= 0
    k = torch.where(nonnegative, k_pos, k_neg).to(log_w.dtype)
    lam = torch.where(nonnegative, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * log_w.exp())
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float | None,
    normalizer: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value-function loss, a token mean (PPO; the VAPO spec's critic loss).

        L_V = 1/2 * mean_M max((V - G)^2, (clip(V, V_old - c, V_old + c) - G)^2)

    With ``cliprange_value=None`` this is the plain ``1/2 * mean_M (V - G)^2``. ``normalizer`` replaces the
    token count exactly as in :func:`policy_loss`.

    Returns:
        ``(loss, stats)`` with ``vf_clip_frac`` (fraction of tokens where the clipped term was larger).
    """
    valid = mask.bool()
    zeros = torch.zeros_like(values)
    returns = torch.where(valid, returns.to(values.dtype), zeros)
    # A padded position's value (inf or NaN from a critic's garbage there) is replaced before any arithmetic: masked
    # after it, its square's gradient would be 0 * NaN = NaN, and reach the value head.
    values = torch.where(valid, values, returns)
    unclipped = (values - returns) ** 2
    if cliprange_value is None:
        per_token = unclipped
        clipped_more = torch.zeros_like(valid)
    else:
        old_values = torch.where(valid, old_values.to(values.dtype), returns)
        clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
        clipped = (clipped_values - returns) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clipped_more = clipped > unclipped
    loss = 0.5 * aggregate_loss(torch.where(valid, per_token, zeros), valid, "token", normalizer)
    stats = {"vf_clip_frac": masked_mean(clipped_more.float(), mask).detach()}
    return loss, stats


def positive_nll_loss(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    is_positive: torch.Tensor,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Positive-example LM loss (VAPO §3.3): mean negative log-likelihood over the tokens of correct responses.

        L_NLL = -1 / (sum_{i in P} |o_i|) * sum_{i in P} sum_t log pi(a_{i,t} | s_{i,t})

    ``P`` is the set of positive (correct) responses. The VAPO policy loss is ``L_PPO + mu * L_NLL``.
    When ``P`` is empty the loss is exactly 0 and still connected to the graph (zero gradient, never NaN).
    ``normalizer`` replaces the positive-token count (use the count over the whole optimisation step).

    Args:
        logprobs: ``[B, T]`` log pi(a_t | s_t) under the current policy.
        mask: ``[B, T]`` valid response tokens.
        is_positive: ``[B]`` bool, True for responses judged correct.
    """
    selected = mask.bool() & is_positive.to(torch.bool).reshape(-1, 1)
    return aggregate_loss(torch.where(selected, -logprobs, torch.zeros_like(logprobs)), selected, "token", normalizer)


def group_normalized_rewards(per_function: torch.Tensor, weights: torch.Tensor, group_size: int) -> torch.Tensor:
    """GDPO's aggregation of several rewards (GRPOConfig's ``multi_objective_aggregation="normalize_then_sum"``,
    arXiv 2601.05242; not in VAPO, which sums the weighted scores): each function's scores are standardised within
    the prompt's group before the weighted sum, so that no function outweighs another by its scale or spread.

        r_i = sum_k w_k (s_ik - mean_{j in g(i)} s_jk) / (std_{j in g(i)} s_jk + 1e-4)

    ``per_function`` is ``[N, F]``, NaN where a function gave no score; ``weights`` ``[F]``; the groups are
    ``group_size`` consecutive rows. A group's mean and standard deviation (Bessel's correction, TRL's ``nanstd``) run
    over the scores given; a missing score adds nothing to the sum, nor does a function with fewer than two scores in
    the group (GRPO's NaN standard deviation, or 0 with one completion per prompt). A row no function scored is NaN.
    """
    rows, functions = per_function.shape
    grouped = per_function.float().view(-1, group_size, functions)
    mean = grouped.nanmean(dim=1, keepdim=True)
    count = (~grouped.isnan()).sum(dim=1, keepdim=True)
    variance = (grouped - mean).pow(2).nansum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
    std = torch.where(count > 1, variance.sqrt(), torch.full_like(variance, math.nan))
    standardised = ((grouped - mean) / (std + 1e-4)).view(rows, functions)
    rewards = (standardised * weights.to(standardised)).nansum(dim=1)
    return torch.where(per_function.isnan().all(dim=1), torch.full_like(rewards, math.nan), rewards)


# ------------------------------------------------------------------ GRPOConfig's policy-token filters (not in VAPO)
def high_entropy_mask(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    threshold_quantile: float,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The high-entropy "forking" tokens, the only ones the policy gradient trains on under GRPOConfig's
    ``top_entropy_quantile`` rho (Wang et al., "Beyond the 80/20 Rule", arXiv 2506.01939; not in VAPO):

        keep_t = m_t and H_t >= Q_q({H_s : m_s = 1}),        q = ``threshold_quantile`` = 1 - rho

    Q_q is ``torch.quantile``'s (linear interpolation) over every valid token of the batch, pooled over processes by
    ``gather`` (the concatenation of every process's 1-D tensor, whatever its length), as GRPOTrainer pools them.
    q = 0 keeps every valid token; q = 1 only those at the maximum. Returns a bool ``[B, T]``; no valid token
    anywhere keeps none.
    """
    valid = mask.bool()
    entropy = entropy.detach()
    local = entropy[valid].float()
    pooled = gather(local) if gather is not None else local
    if pooled.numel() == 0:
        return torch.zeros_like(valid)
    return valid & (entropy >= torch.quantile(pooled, threshold_quantile))


def off_policy_mask(
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (GRPOConfig's ``off_policy_mask_threshold`` delta; not in VAPO): a
    negative advantage does not train where the policy that sampled the sequence has drifted too far from this one.

        keep_{i,t} = A_{i,t} >= 0  or  D_i <= delta,    D_i = mean_{s : m_{i,s} = 1} (log pi_old(y_s) - log pi(y_s))

    D_i, the sequence's own estimate of KL(pi_old || pi), uses the sampler's log-probs ``sampling_logprobs`` (vLLM's
    or a rollout_func's, or the policy's before this rollout's first update) and the current ``logprobs``
    (detached); tokens without a sampler log-prob (NaN) count as no drift. GRPO's advantages are one per sequence
    (``[B, 1]``), VAPO's one per token (``[B, T]``): either broadcasts, so a VAPO token is dropped when its own
    advantage is negative. Returns the keep mask in ``mask``'s dtype, ``advantages``' shape broadcast against
    ``[B, 1]``.
    """
    valid = mask.bool()
    drift = torch.nan_to_num(sampling_logprobs.float() - logprobs.detach().float(), nan=0.0)
    drift = torch.where(valid, drift, torch.zeros_like(drift))
    mean_drift = drift.sum(dim=1, keepdim=True) / valid.sum(dim=1, keepdim=True).clamp(min=1)
    return ((advantages >= 0) | (mean_drift <= threshold)).to(mask.dtype)


def adaptive_entropy_coef(
    coef: float, entropy: float, target: float, delta: float, coef_min: float, coef_max: float
) -> float:
    """GRPOConfig's adaptive entropy control (``use_adaptive_entropy``; not in VAPO), after each optimizer step: the
    coefficient c of the entropy bonus climbs while the policy's entropy H (the step's token mean over every
    process) is at or below the target, and falls while above it.

        c <- min(c + delta, c_max)   if H <= target
        c <- max(c - delta, c_min)   otherwise

    The next step applies c only if H <= target (no bonus while the entropy is high enough).
    """
    return min(coef + delta, coef_max) if entropy <= target else max(coef - delta, coef_min)


def explained_variance(
    values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, all_reduce: AllReduce | None = None
) -> torch.Tensor:
    """Explained variance of the critic, the convergence signal for value pretraining (VC-PPO §5; VAPO §3.1).

        EV = 1 - Var[G - V] / Var[G]      over valid tokens

    1 means perfect prediction, 0 means no better than predicting the mean return, negative is worse than that.
    NaN when the returns have no variance (e.g. every response got the same reward): there is nothing to explain.
    Pass ``all_reduce`` to pool the statistics over data-parallel ranks.
    """
    returns = returns.to(torch.float32)
    _, var_returns, _ = _masked_moments(returns, mask, all_reduce)
    _, var_residual, _ = _masked_moments(returns - values.to(torch.float32), mask, all_reduce)
    if var_returns <= 0:
        return torch.tensor(float("nan"), device=returns.device)
    return 1.0 - var_residual / var_returns


def vapo_loss(
    logprobs: torch.Tensor | None,
    values: torch.Tensor | None,
    batch: dict[str, torch.Tensor],
    *,
    epsilon_low: float,
    epsilon_high: float,
    loss_type: str,
    nll_coef: float,
    vf_coef: float,
    cliprange_value: float | None,
    normalizers: dict[str, torch.Tensor],
    delta: float | None = None,
    entropy_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    importance_sampling_level: str = "token",
    entropy_mask: torch.Tensor | None = None,
    off_policy_mask: torch.Tensor | None = None,
    surrogate: str = "ppo",
    surrogate_params: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one micro-batch (VAPO §3; the spec's formulas), actor and critic together:

        L = vf_coef * L_V  +  L_PPO + mu * L_NLL          (the policy terms only when ``logprobs`` is given,
            - c_H * H                                      the value term only when ``values`` are: a frozen
                                                           value function has none to learn)

    ``delta``, ``importance_sampling_level`` and ``surrogate`` (with ``surrogate_params``, its keyword arguments):
    :func:`policy_loss`'s two-sided clipping, GSPO-token ratio and per-token objective (VAPO's PPO, or GRPO's CISPO,
    SAPO or VESPO).
    ``entropy_coef`` c_H > 0 (not in VAPO, whose Eq. 8-10 have no entropy term; GRPOConfig's ``entropy_coef``)
    subtracts an entropy bonus on the policy's per-token ``entropy`` (which must then carry its gradient):

        H = sum_b (n_b / N) * mean_{t in A_b} H_t         n_b: the micro-batch's tokens, N: the step's (``tokens``)

    the step's token-weighted mean of each micro-batch's mean over the tokens A_b the bonus acts on: every token
    (then H is the step's token mean), or the ``entropy_mask``'s. (GRPOTrainer weighs each micro-batch's mean alike:
    its mean divided by the accumulation steps.)

    GRPOConfig's token masks (``[B, T]`` 0/1, no gradient; None: every token) multiply the PPO term's per-token loss,
    as GRPOTrainer multiplies them in: a masked token's loss is 0, and it still counts in the mean's denominator.
    ``entropy_mask`` (:func:`high_entropy_mask`) also restricts the entropy bonus; ``off_policy_mask``
    (:func:`off_policy_mask`) only the PPO term. The NLL term of the positive examples and the critic's loss keep
    every token.

    ``batch`` holds ``mask``, ``old_logprobs`` (None: the policy that sampled is the one being updated, so the
    detached ``logprobs`` are used), ``old_values``, ``returns``, ``advantages``, ``is_positive`` and optionally
    ``is_weights``. ``normalizers`` give the counts of the whole optimizer step (all micro-batches and ranks):
    ``tokens``, ``sequences`` and ``positive_tokens``, so that summing the micro-batches' losses gives the step's
    token-level mean (see :func:`policy_loss`). Returns the loss and detached statistics: ``loss/value``,
    ``loss/policy``, ``loss/nll`` (each a micro-batch's share of the step's mean, so they sum over micro-batches) and
    token means over this micro-batch of the clip fractions and ``approx_kl``, and the extremes over its sequences
    ``clip_ratio/low_min`` and ``clip_ratio/high_max``.
    """
    mask = batch["mask"]
    if values is None and logprobs is None:
        raise ValueError("vapo_loss needs the policy's log-probs, the critic's values, or both.")
    loss, stats = torch.zeros((), device=mask.device), {}
    if values is not None:
        v_loss, v_stats = value_loss(
            values, batch["old_values"], batch["returns"], mask, cliprange_value, normalizers["tokens"]
        )
        loss = vf_coef * v_loss
        stats = {VALUE_LOSS: v_loss.detach(), "value/clip_ratio": v_stats["vf_clip_frac"]}
    if logprobs is None:
        return loss, stats
    old_logprobs = batch["old_logprobs"] if batch.get("old_logprobs") is not None else logprobs.detach()
    normalizer = normalizers["tokens"] if loss_type == "token" else normalizers["sequences"]
    weights = None
    for token_mask in (entropy_mask, off_policy_mask):
        if token_mask is not None:
            weights = token_mask if weights is None else weights * token_mask
    pg_loss, pg_stats = policy_loss(
        logprobs,
        old_logprobs,
        batch["advantages"],
        mask,
        epsilon_low,
        epsilon_high,
        loss_type,
        normalizer,
        weights=weights,
        delta=delta,
        importance_sampling_level=importance_sampling_level,
        surrogate=surrogate,
        is_weights=batch.get("is_weights"),
        **(surrogate_params or {}),
    )
    loss = loss + pg_loss
    stats["loss/policy"] = pg_loss.detach()
    if entropy_coef:
        if entropy is None or not entropy.requires_grad:
            raise ValueError("entropy_coef > 0 needs the policy's per-token entropy with its gradient.")
        acted_on = mask if entropy_mask is None else mask * entropy_mask
        bonus = mask.sum() / normalizers["tokens"] * masked_mean(entropy, acted_on)
        loss = loss - entropy_coef * bonus
        stats["loss/entropy_bonus"] = bonus.detach()
    if nll_coef > 0:
        nll = positive_nll_loss(logprobs, mask, batch["is_positive"], normalizers["positive_tokens"])
        loss = loss + nll_coef * nll
        stats["loss/nll"] = nll.detach()
    # GRPOTrainer's names: its clip fractions for PPO, `cispo_clip_ratio`, `vespo/phi_seq_mean` (SAPO has none).
    high = "cispo_clip_ratio" if surrogate == "cispo" else "clip_ratio/high_mean"
    names = {"clip_frac_low": "clip_ratio/low_mean", "clip_frac_high": high, "clip_frac": "clip_ratio/region_mean"}
    names |= {"clip_frac_low_min": "clip_ratio/low_min", "clip_frac_high_max": "clip_ratio/high_max"}
    names["phi"] = "vespo/phi_seq_mean"
    stats.update({names[key]: value for key, value in pg_stats.items() if key in names})
    stats["approx_kl"] = pg_stats["approx_kl"]
    return loss, stats


def importance_sampling_weights(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_max: float | None = 3.0,
    clip_min: float | None = None,
) -> torch.Tensor:
    """TRL's importance-sampling weights for completions sampled by vLLM but trained on with the trainer's model.

    As `GRPOTrainer._generate_and_score_completions` (trl 1.16, `trl/trainer/grpo_trainer.py` lines 2660-2708):

        d_t = (log pi_trainer(y_t) - log pi_sampler(y_t)) * mask_t,   NaN -> 0 (a token vLLM could not score)
        token_*:    rho_t = exp(d_t)                                   shape [N, C]
        sequence_*: rho   = exp(sum_t d_t)                             shape [N, 1], one weight per completion
        *_truncate: rho <- clamp(rho, clip_min, clip_max)
        *_mask:     rho <- 0 where rho < clip_min or rho > clip_max   (a missing bound is no bound)

    `trainer_logprobs` are the old log-probs (the policy before this rollout's updates, at the sampling
    temperature), no gradient. TRL multiplies the per-token policy loss by rho after the clipped surrogate and before
    the KL term and the masked mean (lines 3146-3147), as :func:`policy_loss` does with its ``weights``.
    Defaults are `GRPOConfig`'s (`vllm_importance_sampling_mode="sequence_mask"`, `..._clip_max=3.0`,
    `..._clip_min=None`).
    """
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(
            f"Unknown vllm_importance_sampling_mode {mode!r}; expected one of {IMPORTANCE_SAMPLING_MODES}"
        )
    diff = torch.nan_to_num((trainer_logprobs - sampler_logprobs) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        if clip_min is None and clip_max is None:
            raise ValueError("A *_truncate importance-sampling mode needs clip_min or clip_max.")
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def explained_variance_plateaued(readings: Sequence[float], window: int, min_delta: float) -> bool:
    """Value pretraining's stop rule (VAPO §3.1: pretrain "until value loss and explained variance converge").

        stop  when  median(EV[-w:]) - median(EV[-2w:-w]) < min_delta        over the finite readings, w = ``window``

    One rollout's explained variance is a noisy reading. Comparing it with the best reading so far is biased: the
    maximum of noisy readings sits above the critic's true level, so a single lucky rollout sets a bar later ones
    rarely clear and pretraining stops early. Two adjacent windows' levels have no such bias; medians, not means: a
    reading is bounded above by 1 and not below (a rollout whose returns barely vary, 7 of 8 samples alike, reads
    -9 for a critic that reads 0.4 elsewhere), and one such reading moved a window's mean enough to stop a rising
    critic (or to hold a flat one). NaN readings (every return equal, nothing to explain) say nothing about the
    critic and are left out; so the rule needs ``2 * window`` finite readings before it can stop. It reads the
    explained variance alone: the value loss scales with the returns' variance, which moves with the rollout's
    rewards, where the explained variance is normalised by it.
    """
    finite = [float(r) for r in readings if math.isfinite(r)]
    if window < 1 or len(finite) < 2 * window:
        return False
    return statistics.median(finite[-window:]) - statistics.median(finite[-2 * window : -window]) < min_delta
