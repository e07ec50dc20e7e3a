"""Speculative decoding (DESIGN.md §6): the algorithm registry, the proposers, and the lossless
verification that keeps a speculative run's output exactly the target model's (greedy) or
distributed exactly as the target's (sampling)."""
