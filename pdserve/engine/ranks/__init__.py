"""The processes of a tensor-parallel worker: rank 0's `RankGroup`, which keeps the other ranks
in lock-step, the other ranks' loop (`rank_worker.py`), nodes other than 0, and KV pages in
the layout a tcp handoff moves.
"""
