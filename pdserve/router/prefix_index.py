"""What the router remembers of each worker's prefix cache, for cache-aware routing. Torch-free.

A request's routing key (its text, or its token ids: `routing_key`) is cut into blocks, and
each block is named by a hash of every block up to it, so a block's name stands for the whole
prefix that ends with it: a path in a prefix tree, as sglang-router keeps one per worker,
without the tree. A worker's index holds the names of the prefixes sent to it, least recently
used first out once it holds `capacity` of them; a key's match on a worker is how many of its
leading blocks the worker has seen. It is an approximation of the worker's real cache (which
evicts on its own), good enough to send a conversation's next turn where its last one went.

Memory: a name is 8 bytes in one array (a dict of Python ints cost ~200 bytes a name: ~200 MB
per worker at the default capacity of 2^20 names, 8 MB now). The array is set-associative: a
name can only sit among the `WAYS` slots of the bucket its value picks, most recently used
first, and a new name pushes out the bucket's least recently used one. That is LRU per bucket,
close to LRU overall, without a linked list or any object per name.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

RoutingKey = str | tuple[int, ...]

TEXT_BLOCK = 32  # characters per block of a text key
TOKEN_BLOCK = 8  # token ids per block of a token key
# Blocks of a key that count: its first 32k characters or 8k token ids. A conversation grows
# at its end, so its beginning tells workers apart; and a huge body costs the router's event
# loop no more hashing than this.
MAX_BLOCKS = 1024
WAYS = 8  # slots per bucket of an index
EMPTY = 0  # NOTE: a free slot; a name that hashes to 0 is stored as 1 instead


def block_names(key: RoutingKey) -> list[int]:
    """One name per full block of `key`, each a hash of the blocks up to it."""
    size = TEXT_BLOCK if isinstance(key, str) else TOKEN_BLOCK
    names, previous = [], 0
    for start in range(0, min(len(key), MAX_BLOCKS * size) - size + 1, size):
        previous = hash((previous, key[start : start + size]))
        names.append(previous)
    return names


def block_units(key: RoutingKey) -> int:
    """Characters or token ids per block of this kind of key."""
    return TEXT_BLOCK if isinstance(key, str) else TOKEN_BLOCK


class PrefixIndex:
    """The prefixes one worker was sent, by block name, least recently used first out (per
    bucket: the module docstring)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"a prefix index needs a capacity of at least 1, got {capacity}")
        self.ways = min(WAYS, capacity)
        self.buckets = capacity // self.ways
        self.capacity = self.buckets * self.ways
        self._slots = array("q", bytes(8 * self.capacity))
        self._used = 0

    def __len__(self) -> int:
        return self._used

    def match(self, names: Sequence[int]) -> int:
        """How many of the leading `names` this worker has seen."""
        count = 0
        for name in names:
            start = self._bucket(name)
            if (name or 1) not in self._slots[start : start + self.ways]:
                break
            count += 1
        return count

    def insert(self, names: Sequence[int]) -> None:
        """Remember `names` as the most recently used, pushing out the least recently used
        of their buckets."""
        # NOTE: longest prefix first, so a key's shorter prefixes end up the most recent and
        # its longest ones leave first, as a tree's leaves would.
        slots, ways = self._slots, self.ways
        for name in reversed(names):
            name = name or 1
            start = self._bucket(name)
            bucket = slots[start : start + ways]
            try:
                at = bucket.index(name)
            except ValueError:
                at = ways - 1  # NOTE: free slots are the bucket's last ones
                if bucket[at] == EMPTY:
                    self._used += 1
            slots[start + 1 : start + at + 1] = bucket[:at]
            slots[start] = name

    def _bucket(self, name: int) -> int:
        return ((name or 1) % self.buckets) * self.ways


def routing_key(body: dict) -> RoutingKey | None:
    """The part of a request that decides which cache can serve it: a chat's messages (role
    and text, in order), a completion's prompt, a /generate's text or input ids. None where
    there is nothing to go by (a cache-aware policy then balances load alone)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(_message_text(m) for m in messages) or None
    for field in ("prompt", "text", "input_ids"):
        value = body.get(field)
        if isinstance(value, list) and len(value) == 1:
            value = value[0]  # one prompt in a list
        if isinstance(value, str):
            return value or None
        if isinstance(value, list) and value and all(type(v) is int for v in value):
            return tuple(value)
    return None


def _message_text(message) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        # NOTE: a part whose text is no string is the worker's to refuse (400); the key,
        # built before any worker sees the body, must take any JSON.
        content = "".join(
            text
            for p in content
            if isinstance(p, dict)
            and p.get("type") == "text"
            and isinstance(text := p.get("text"), str)
        )
    if not isinstance(content, str):
        content = ""
    return f"<{message.get('role')}>{content}"
