"""NGRAM: proposals from suffix matches over prompt + output. No draft model, no draft KV, no
seed state. The longest suffix of the sequence (up to `max_ngram` tokens) that occurred before
proposes the tokens that followed its most recent earlier occurrence; as a tree, the `topk`
most recent distinct continuations are merged into a trie."""

from __future__ import annotations

from typing import ClassVar

from pdserve.speculative.algorithm import (
    Capabilities,
    SpeculativeAlgorithm,
    draft_states_from_records,
)
from pdserve.speculative.tree import ROOT, DraftTree

MAX_NGRAM = 3
MIN_NGRAM = 1


def continuations(
    tokens: list[int], length: int, limit: int, max_ngram: int = MAX_NGRAM, min_ngram: int = 1
):
    """Up to `limit` distinct continuations (each up to `length` tokens) of the sequence's
    suffix: longest matching suffix first, most recent occurrence first."""
    if length < 1 or limit < 1 or not 1 <= min_ngram <= max_ngram:
        raise ValueError("need length >= 1, limit >= 1 and 1 <= min_ngram <= max_ngram")
    found: list[list[int]] = []
    end = len(tokens)
    for n in range(min(max_ngram, end - 1), min_ngram - 1, -1):
        suffix = tokens[end - n :]
        # NOTE: the most recent earlier occurrence first (any but the suffix itself).
        for start in range(end - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + length]
                if follow and follow not in found:
                    found.append(follow)
                    if len(found) == limit:
                        return found
    return found


def propose_ngram(
    tokens: list[int], num_draft: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM
) -> list[int]:
    """Up to `num_draft` proposed next tokens (a chain); [] when no suffix repeats."""
    if num_draft < 1:
        raise ValueError("need num_draft >= 1")
    found = continuations(tokens, num_draft, 1, max_ngram, min_ngram)
    return found[0] if found else []


def propose_ngram_tree(
    tokens: list[int], depth: int, topk: int, max_nodes: int, max_ngram: int = MAX_NGRAM
) -> DraftTree:
    """The `topk` best continuations merged into a trie of at most `max_nodes` nodes."""
    trie_tokens: list[int] = []
    parents: list[int] = []
    child_of: dict[tuple[int, int], int] = {}
    for follow in continuations(tokens, depth, topk, max_ngram):
        parent = ROOT
        for token in follow:
            node = child_of.get((parent, token))
            if node is None:
                if len(trie_tokens) == max_nodes:
                    break
                node = len(trie_tokens)
                trie_tokens.append(token)
                parents.append(parent)
                child_of[(parent, token)] = node
            parent = node
    return DraftTree(trie_tokens, parents)


class Ngram(SpeculativeAlgorithm):
    name: ClassVar[str] = "NGRAM"
    capabilities: ClassVar[Capabilities] = Capabilities(
        has_draft_kv=False, carries_hidden=False, seeds_topk=False
    )

    def propose(self, requests: list) -> list[DraftTree]:
        s = self.settings
        if s.is_chain:
            return [DraftTree.chain(propose_ngram(r.token_ids, s.num_steps)) for r in requests]
        return [
            propose_ngram_tree(r.token_ids, s.num_steps, s.eagle_topk, s.num_draft_tokens - 1)
            for r in requests
        ]

    def build_disagg_draft_input(self, batch, last_tokens, records):
        # NOTE: nothing to seed (the proposals come from the tokens), but the records are
        # still checked: a peer that sends seed state disagrees with the handshake.
        return draft_states_from_records(self, batch, last_tokens, records)
