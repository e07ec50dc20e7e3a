"""Challenge-response over the shared transfer token. Torch-free.

Each side proves it holds the token with HMAC-SHA256 over both sides' fresh nonces and a
label naming the prover's role, so the token never crosses the wire, a proof seen once is
useless later (the other side's nonce is new every time), and a proof made by one role is
never valid for the other. Without a token configured the same handshake runs with an empty
key: it then proves nothing, exactly as an unauthenticated setup promises.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

NONCE_BYTES = 16


class NonceError(ValueError):
    """A peer sent a nonce of the wrong size."""


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def check_nonce(nonce: bytes) -> None:
    if len(nonce) != NONCE_BYTES:
        raise NonceError(f"handshake nonce must be {NONCE_BYTES} bytes, got {len(nonce)}")


def prefill_proof(token: str, decode_nonce: bytes, prefill_nonce: bytes) -> bytes:
    return _proof(token, b"pdserve-prefill", decode_nonce, prefill_nonce)


def decode_proof(token: str, prefill_nonce: bytes, decode_nonce: bytes) -> bytes:
    return _proof(token, b"pdserve-decode", prefill_nonce, decode_nonce)


def proof_ok(expected: bytes, given: bytes) -> bool:
    return hmac.compare_digest(expected, given)


def _proof(token: str, label: bytes, first: bytes, second: bytes) -> bytes:
    # NOTE: both nonces have a fixed size, so the concatenation is unambiguous.
    return hmac.new(token.encode(), label + b"\0" + first + second, hashlib.sha256).digest()
