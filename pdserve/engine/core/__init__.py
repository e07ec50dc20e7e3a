"""The engine's bookkeeping, torch-free: configuration, requests and their sampling settings,
the scheduler, the page allocator, the prefix cache, outputs and request errors. Tested on CPU
without a model; everything else in `engine/` builds on it.
"""
