"""Handshake and control messages between a prefill worker and a decode worker.

The decode side registers once per peer with its layout; the prefill side compares it with
its own and refuses a mismatch with a reason that names every differing field.
"""

from __future__ import annotations

from pdserve.protocol.codec import message


@message("spec_layout")
class SpecLayout:
    """Speculative decoding settings both sides must share (None/0 without speculation)."""

    algorithm: str | None = None
    topk: int = 0
    num_steps: int = 0
    spec_hidden_size: int | None = None
    hidden_dtype: str | None = None
    has_draft_kv: bool = False
    draft_num_layers: int = 0


@message("kv_layout")
class KVLayout:
    """What must be equal on both sides for pages to be copied byte for byte."""

    model_fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    kv_dtype: str
    spec: SpecLayout
