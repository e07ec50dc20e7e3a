"""Lossless verification of a draft tree against the target.

Drafts are deterministic (a draft model's top-k, an n-gram match): the proposal distribution of
each candidate is a point mass. Rows are 0 for the root (the last committed token) and i + 1
for tree node i; row r's distribution is the target's next-token distribution after the root's
path to r.

- greedy (`accept_greedy`): from the root, follow the child whose token is the target's choice
  at the current row; stop at the first row none matches and emit the target's choice there.
  Exactly the target's greedy tokens.
- sampling (`accept_sampling`, recursive rejection with point-mass proposals): at row r with
  distribution p and children c_1..c_m, accept c_1 with probability p(c_1); if rejected, set
  p(c_1) = 0, renormalize and try c_2, and so on; after the last rejection emit a draw from the
  renormalized residual. This is speculative sampling (accept d with probability
  min(1, p(d) / q(d)), else draw from norm(max(p - q, 0))) for a point mass q = delta_c: it
  accepts with min(1, p(c) / 1) = p(c) and its residual is p without c, so each emitted token
  is distributed exactly as p: P(c_1) = p(c_1) and, for x not c_1,
  P(x) = (1 - p(c_1)) * p(x) / (1 - p(c_1)) = p(x), applied recursively.
"""

from __future__ import annotations

import torch


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


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of unnormalized non-negative weights."""
    total = probs.sum(dim=-1, keepdim=True)
    # NOTE: a zero residual means the target's whole mass was on rejected candidates: that
    # rejection had probability 0 in exact arithmetic (rounding made it happen); draw
    # uniformly rather than divide by zero.
    probs = torch.where(total > 0, probs / total.clamp_min(1e-30), torch.ones_like(probs))
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
