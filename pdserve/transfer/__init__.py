"""KV and metadata transfer from a prefill worker to a decode worker (docs/architecture/).

Bookkeeping (room states, deadlines, tombstones, handshake checks) is torch-free; tensors only
appear in the backends that move KV pages.
"""
