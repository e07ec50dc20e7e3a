"""Checkpoints built offline with seeded random weights: the built-in tiny model and its
byte-level BPE tokenizer (tests, `pdserve launch` without a model), and full-size models with
real public configs (`--preset`, benchmarks).
"""
