"""NGRAM proposals: no draft model, no draft KV. The longest suffix of the sequence (prompt +
output, up to `max_ngram` tokens) that occurred before proposes the tokens that followed its
most recent earlier occurrence."""

from __future__ import annotations


def propose_ngram(
    tokens: list[int], num_draft: int, max_ngram: int = 3, min_ngram: int = 1
) -> list[int]:
    """Up to `num_draft` proposed next tokens; [] when no suffix repeats."""
    if num_draft < 1 or not 1 <= min_ngram <= max_ngram:
        raise ValueError("need num_draft >= 1 and 1 <= min_ngram <= max_ngram")
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - n :]
        # NOTE: the most recent earlier occurrence first (any but the suffix itself).
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + num_draft]
                if follow:
                    return follow
    return []
