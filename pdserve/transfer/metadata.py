"""The per-request metadata record (first token, speculative seed state) and its wire form.

On the wire: a `MetadataHeader` message, then one frame holding topk_index (int64), topk_p
(float32) and hidden_states (the draft's dtype), in that order (widest element first, so every
part stays aligned for a zero-copy view). The receiver knows every size
from the handshake (`MetadataSpec`), so it checks the frame's length before building tensors:
a peer cannot make it allocate anything it did not agree to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.protocol.metadata_spec import MetadataSpec
from pdserve.protocol.transfer_messages import MetadataHeader

MAX_TOP_LOGPROBS = 20  # the most top alternatives any API asks for


class MetadataMismatch(ValueError):
    """A record disagrees with the agreed MetadataSpec; the message names the field."""


@dataclass
class MetadataRecord:
    first_token: int
    cached_tokens: int = 0
    first_logprob: float | None = None
    first_top_logprobs: dict[int, float] | None = None
    topk_p: torch.Tensor | None = None  # [topk] float32
    topk_index: torch.Tensor | None = None  # [topk] int64, target-vocabulary ids
    hidden_states: torch.Tensor | None = None  # [spec hidden size] in the draft dtype

    def check(self, spec: MetadataSpec) -> None:
        """Raise MetadataMismatch unless every tensor has the agreed shape and dtype."""
        if spec.topk:
            _expect(self.topk_p, "topk_p", (spec.topk,), torch.float32)
            _expect(self.topk_index, "topk_index", (spec.topk,), torch.int64)
        elif self.topk_p is not None or self.topk_index is not None:
            raise MetadataMismatch("topk_p/topk_index given but the handshake agreed topk=0")
        if spec.hidden_size is not None:
            _expect(
                self.hidden_states,
                "hidden_states",
                (spec.hidden_size,),
                _dtype(spec.hidden_dtype),
            )
        elif self.hidden_states is not None:
            raise MetadataMismatch(
                "hidden_states given but the algorithm carries none (expected None)"
            )

    def pack(self, room: int, spec: MetadataSpec) -> tuple[MetadataHeader, bytes]:
        self.check(spec)
        parts = [t for t in (self.topk_index, self.topk_p, self.hidden_states) if t is not None]
        payload = b"".join(_tensor_bytes(t) for t in parts)
        header = MetadataHeader(
            room=room,
            first_token=self.first_token,
            cached_tokens=self.cached_tokens,
            first_logprob=self.first_logprob,
            first_top_logprobs=(
                None
                if self.first_top_logprobs is None
                else [[t, lp] for t, lp in self.first_top_logprobs.items()]
            ),
            topk=spec.topk,
            has_hidden=spec.hidden_size is not None,
        )
        return header, payload

    @classmethod
    def unpack(cls, header: MetadataHeader, payload: bytes, spec: MetadataSpec) -> MetadataRecord:
        if header.topk != spec.topk:
            raise MetadataMismatch(f"topk: record has {header.topk}, handshake agreed {spec.topk}")
        if header.has_hidden != (spec.hidden_size is not None):
            raise MetadataMismatch(
                f"hidden_states: record {'has' if header.has_hidden else 'lacks'} them, the "
                f"handshake agreed hidden_size={spec.hidden_size}"
            )
        if len(payload) != spec.nbytes:
            raise MetadataMismatch(
                f"metadata payload of {len(payload)} bytes, expected {spec.nbytes}"
            )
        top = header.first_top_logprobs
        if top is not None and len(top) > MAX_TOP_LOGPROBS:
            raise MetadataMismatch(
                f"first_top_logprobs has {len(top)} entries, at most {MAX_TOP_LOGPROBS} allowed"
            )
        if top is not None and any(len(pair) != 2 for pair in top):
            raise MetadataMismatch("first_top_logprobs entries must be [token id, logprob]")
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else None
        record = cls(header.first_token, header.cached_tokens, header.first_logprob)
        if top is not None:
            record.first_top_logprobs = {int(t): float(lp) for t, lp in top}
        offset = 0
        if spec.topk:
            record.topk_index = data[offset : offset + 8 * spec.topk].view(torch.int64)
            offset += 8 * spec.topk
            record.topk_p = data[offset : offset + 4 * spec.topk].view(torch.float32)
            offset += 4 * spec.topk
        if spec.hidden_size is not None:
            record.hidden_states = data[offset:].view(_dtype(spec.hidden_dtype))
        return record


def _expect(tensor, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tensor is None:
        raise MetadataMismatch(f"{name} is missing; the handshake agreed shape {shape} {dtype}")
    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
        raise MetadataMismatch(
            f"{name}: got shape {tuple(tensor.shape)} {tensor.dtype}, "
            f"the handshake agreed {shape} {dtype}"
        )


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().contiguous().view(-1)
    return flat.view(torch.uint8).cpu().numpy().tobytes()


def _dtype(name: str | None) -> torch.dtype:
    """The torch dtype the handshake named ("bfloat16", ...)."""
    dtype = getattr(torch, name or "", None)
    if not isinstance(dtype, torch.dtype):
        raise MetadataMismatch(f"unknown hidden_dtype {name!r} in the metadata spec")
    return dtype
