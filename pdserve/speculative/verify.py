"""Lossless verification.

A chain drawn from a stochastic draft (`verify_sampling`): given k draft tokens d_1..d_k, the
target's distributions p_0..p_k (p_i after the prefix and d_1..d_i) and the draft's
q_0..q_{k-1} (q_i proposed d_{i+1}):

- speculative sampling: accept d_{i+1} with probability min(1, p_i(d) / q_i(d));
  at the first rejection emit a sample of norm(max(p_i - q_i, 0)) and stop; when all k were
  accepted emit a sample of p_k. Every emitted token is distributed exactly as the target's
  would be: P(emit x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) r(x) = p(x),
  with r the normalized residual.

It verifies a batch of chains at once and returns, per row, how many draft tokens were accepted
and the one token emitted after them. The engine's drafts are deterministic trees; they are
verified by `accept_greedy` and `accept_sampling` below.
"""

from __future__ import annotations

import torch


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


# ---- trees of deterministic proposals (what the engine verifies) ---------------------------
#
# Drafts in the engine are deterministic (a draft model's top-k, an n-gram match): the
# proposal distribution of each candidate is a point mass. Rows are 0 for the root (the last
# committed token) and i + 1 for tree node i; row r's distribution is the target's next-token
# distribution after the root's path to r.
#
# - greedy: from the root, follow the child whose token is the target's choice at the current
#   row; stop at the first row none matches and emit the target's choice there. Exactly the
#   target's greedy tokens.
# - sampling (recursive rejection with point-mass proposals): at row r with distribution p and
#   children c_1..c_m, accept c_1 with probability p(c_1); if rejected, set p(c_1) = 0,
#   renormalize and try c_2, and so on; after the last rejection emit a draw from the
#   renormalized residual. For a point mass q = delta_c the speculative-sampling rule accepts
#   with min(1, p(c) / 1) = p(c) and the residual norm(max(p - q, 0)) is p without c, so each
#   emitted token is distributed exactly as p: P(c_1) = p(c_1) and, for x not c_1,
#   P(x) = (1 - p(c_1)) * p(x) / (1 - p(c_1)) = p(x), applied recursively.


def accept_greedy(tree, choices: list[int]) -> tuple[list[int], int]:
    """choices[r]: the target's token at row r. -> (accepted nodes root to leaf, bonus)."""
    path: list[int] = []
    row = 0
    while True:
        want = choices[row]
        parent = path[-1] if path else -1
        nxt = next((c for c in tree.children(parent) if tree.tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        row = nxt + 1


def accept_sampling(tree, probs_of_row, generator: torch.Generator | None = None):
    """probs_of_row(r) -> the target's distribution [V] at row r (normalized). -> (accepted
    nodes root to leaf, the token emitted after them)."""
    path: list[int] = []
    row = 0
    while True:
        p = probs_of_row(row).clone()
        parent = path[-1] if path else -1
        accepted = None
        for child in tree.children(parent):
            token = tree.tokens[child]
            total = float(p.sum())
            if total <= 0:
                break
            u = float(torch.rand((), generator=generator, device=p.device))
            if u * total < float(p[token]):
                accepted = child
                break
            p[token] = 0.0
        if accepted is None:
            return path, int(_sample(p[None, :], generator)[0])
        path.append(accepted)
        row = accepted + 1
