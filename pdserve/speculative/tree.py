"""A draft: tokens proposed after a sequence's last committed token (the root), as a tree.

A chain (topk 1) is the tree where every node's parent is the node before it. Torch-free
bookkeeping: depths, the mask of which query tokens a node may attend to during verification,
truncation near a request's token limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROOT = -1  # parent of the first-level nodes: the last committed token


@dataclass(frozen=True)
class DraftTree:
    """tokens[i] is node i's token; parents[i] its parent's index (ROOT for the root's
    children). Parents come before their children."""

    tokens: list[int]
    parents: list[int]
    depths: list[int] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        depths: list[int] = []
        for index, parent in enumerate(self.parents):
            if not ROOT <= parent < index:
                raise ValueError(f"node {index} has parent {parent}; parents come first")
            depths.append(1 if parent == ROOT else depths[parent] + 1)
        object.__setattr__(self, "depths", depths)

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    @classmethod
    def empty(cls) -> DraftTree:
        return cls([], [])

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(parent == index - 1 for index, parent in enumerate(self.parents))

    def children(self, parent: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == parent]

    def truncated(self, max_depth: int) -> DraftTree:
        """The nodes at depth <= max_depth (a request near its token limit)."""
        if all(d <= max_depth for d in self.depths):
            return self
        keep = [i for i, d in enumerate(self.depths) if d <= max_depth]
        new_index = {old: new for new, old in enumerate(keep)}
        parents = [ROOT if self.parents[i] == ROOT else new_index[self.parents[i]] for i in keep]
        return DraftTree([self.tokens[i] for i in keep], parents)

    def attention_mask(self) -> list[list[bool]]:
        """[1 + N][1 + N]: row r (0 = root, i + 1 = node i) may see column c when c is r
        itself or one of its ancestors (the root is everyone's ancestor)."""
        size = len(self.tokens) + 1
        rows = [[False] * size for _ in range(size)]
        rows[0][0] = True
        for index, parent in enumerate(self.parents):
            row = rows[index + 1]
            row[:] = rows[parent + 1] if parent != ROOT else rows[0]
            row[index + 1] = True
        return rows

    def path_tokens(self, node: int) -> list[int]:
        """Tokens from the root's first child down to `node` (inclusive)."""
        path = []
        while node != ROOT:
            path.append(self.tokens[node])
            node = self.parents[node]
        return path[::-1]
