"""Tensor parallelism's arithmetic and collectives: how a model splits over ranks
(`ModelSplit`), one rank's group (`TensorParallel`), and the one-shot all-reduce for the small
activations of decode steps. The rank processes that use them are in `engine/ranks/`.
"""
