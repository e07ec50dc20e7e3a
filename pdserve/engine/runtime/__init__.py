"""What runs on the device: the model (`models/`) and its attention backends (`attention/`),
the KV pool, the device page table, one forward pass (`ForwardBatch`, `ModelRunner`), CUDA
graphs, the sampler, overlap placeholders, and start-up (`loader.py`: device, dtype, model,
KV pool).
"""
