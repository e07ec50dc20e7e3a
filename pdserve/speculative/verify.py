"""Lossless verification of a drafted chain (one draft token per step, topk 1).

Given k draft tokens d_1..d_k, the target's distributions p_0..p_k (p_i after the prefix and
d_1..d_i) and the draft's q_0..q_{k-1} (q_i proposed d_{i+1}):

- greedy: accept d_{i+1} while it equals argmax p_i; then emit argmax p_j at the first
  mismatch j (or p_k's argmax when all k were accepted). The output is exactly the target's.
- sampling (speculative sampling): accept d_{i+1} with probability min(1, p_i(d) / q_i(d));
  at the first rejection emit a sample of norm(max(p_i - q_i, 0)) and stop; when all k were
  accepted emit a sample of p_k. Every emitted token is distributed exactly as the target's
  would be: P(emit x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) r(x) = p(x),
  with r the normalized residual.

Each function verifies a batch of chains at once and returns, per row, how many draft tokens
were accepted and the one token emitted after them.
"""

from __future__ import annotations

import torch


def verify_greedy(target_logits: torch.Tensor, draft: torch.Tensor):
    """target_logits [B, k+1, V], draft [B, k] -> (accepted [B], next_token [B])."""
    _check(target_logits, draft)
    best = target_logits.argmax(dim=-1)  # [B, k+1]
    matches = (best[:, :-1] == draft).long()
    accepted = matches.cumprod(dim=1).sum(dim=1)  # leading run of matches
    next_token = best.gather(1, accepted.unsqueeze(1)).squeeze(1)
    return accepted, next_token


def verify_sampling(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft: torch.Tensor,
    generator: torch.Generator | None = None,
):
    """target_probs [B, k+1, V], draft_probs [B, k, V] (draft[:, i] was drawn from
    draft_probs[:, i]), draft [B, k] -> (accepted [B], next_token [B])."""
    _check(target_probs, draft)
    batch, k = draft.shape
    if draft_probs.shape != (batch, k, target_probs.shape[-1]):
        raise ValueError(
            f"draft_probs must be [B, k, V] = {[batch, k, target_probs.shape[-1]]}, "
            f"got {list(draft_probs.shape)}"
        )
    rows = torch.arange(batch, device=draft.device)
    accepted = torch.zeros(batch, dtype=torch.long, device=draft.device)
    next_token = torch.full((batch,), -1, dtype=torch.long, device=draft.device)
    alive = torch.ones(batch, dtype=torch.bool, device=draft.device)
    for i in range(k):
        token = draft[:, i]
        p = target_probs[rows, i, token]
        q = draft_probs[rows, i, token]
        u = torch.rand(batch, generator=generator, device=draft.device)
        # Accept with probability min(1, p/q): u * q < p (q > 0: the draft drew this token).
        ok = alive & (u * q < p)
        rejected = alive & ~ok
        if rejected.any():
            residual = (target_probs[rejected, i] - draft_probs[rejected, i]).clamp_min(0)
            next_token[rejected] = _sample(residual, generator)
        accepted += ok.long()
        alive = ok
    if alive.any():
        next_token[alive] = _sample(target_probs[alive, k], generator)
    return accepted, next_token


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of unnormalized non-negative weights."""
    total = probs.sum(dim=-1, keepdim=True)
    # NOTE: a zero residual means p <= q everywhere, i.e. p == q: rejection had probability 0
    # in exact arithmetic; fall back to p's support (uniform) rather than dividing by zero.
    probs = torch.where(total > 0, probs / total.clamp_min(1e-30), torch.ones_like(probs))
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def _check(target: torch.Tensor, draft: torch.Tensor) -> None:
    if draft.dim() != 2 or target.dim() != 3:
        raise ValueError("target must be [B, k+1, V] and draft [B, k]")
    if target.shape[:2] != (draft.shape[0], draft.shape[1] + 1):
        raise ValueError(
            f"target has {list(target.shape[:2])} rows/positions; draft {list(draft.shape)} "
            "needs [B, k+1]"
        )
