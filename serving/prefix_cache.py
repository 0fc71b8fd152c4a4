"""A block prefix KV cache with a token budget, shared by the local engine and the simulated engine.

Sequences are cut into blocks of ``block_size`` tokens; a block is identified by the chain
(adapter, previous block, its tokens), so a lookup walks from the first block and stops at the first
miss, like a radix tree whose edges are whole blocks. Blocks referenced by running requests are
locked; unlocked blocks are evicted least-recently-used first (deepest first on ties, so a chain is
cut from its end). The payload (per-layer K/V slices for the local engine, nothing for the
simulator) is opaque here.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(eq=False)
class Block:
    key: int
    parent: "Block | None"
    tokens: tuple[int, ...]
    depth: int
    payload: Any = None
    refs: int = 0
    last_use: int = 0
    children: int = 0


@dataclass
class CacheStats:
    lookups_tokens: int = 0
    hit_tokens: int = 0
    evicted_tokens: int = 0


class PrefixCache:
    def __init__(self, block_size: int = 16):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._blocks: dict[int, Block] = {}
        self._clock = itertools.count(1)
        self.cached_tokens = 0  # tokens held by all blocks
        self.locked_tokens = 0  # tokens held by blocks with refs > 0
        self.stats = CacheStats()

    def _key(self, adapter: str | None, parent: Block | None, tokens: tuple[int, ...]) -> int:
        return hash((adapter, parent.key if parent else 0, tokens))

    @property
    def evictable_tokens(self) -> int:
        return self.cached_tokens - self.locked_tokens

    def match(self, adapter: str | None, tokens: Sequence[int], *, max_tokens: int | None = None) -> list[Block]:
        """The longest chain of cached blocks that prefixes ``tokens`` (at most ``max_tokens``)."""
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        bs = self.block_size
        chain: list[Block] = []
        parent = None
        stamp = next(self._clock)
        for start in range(0, limit - bs + 1, bs):
            piece = tuple(tokens[start:start + bs])
            block = self._blocks.get(self._key(adapter, parent, piece))
            if block is None or block.tokens != piece or block.parent is not parent:
                break
            block.last_use = stamp
            chain.append(block)
            parent = block
        return chain

    def record_lookup(self, total_tokens: int, hit_tokens: int) -> None:
        self.stats.lookups_tokens += total_tokens
        self.stats.hit_tokens += hit_tokens

    def insert(self, adapter: str | None, tokens: Sequence[int], payloads: Sequence[Any] | None = None,
               *, have: Sequence[Block] = ()) -> list[Block]:
        """Add the full blocks of ``tokens`` (``have`` is an already-matched prefix chain); return the
        whole chain. ``payloads[i]`` belongs to block ``i`` (counted from the start of ``tokens``).
        The caller must have made room (see ``evict``)."""
        bs = self.block_size
        chain = list(have)
        parent = chain[-1] if chain else None
        stamp = next(self._clock)
        for i in range(len(chain), len(tokens) // bs):
            piece = tuple(tokens[i * bs:(i + 1) * bs])
            key = self._key(adapter, parent, piece)
            block = self._blocks.get(key)
            if block is None or block.tokens != piece or block.parent is not parent:
                if block is not None:  # hash collision: keep the old one, do not cache this chain further
                    break
                block = Block(key, parent, piece, i, payloads[i] if payloads is not None else None)
                self._blocks[key] = block
                self.cached_tokens += bs
                if parent is not None:
                    parent.children += 1
            block.last_use = stamp
            chain.append(block)
            parent = block
        return chain

    def lock(self, chain: Sequence[Block]) -> None:
        for block in chain:
            if block.refs == 0:
                self.locked_tokens += self.block_size
            block.refs += 1

    def unlock(self, chain: Sequence[Block]) -> None:
        for block in chain:
            block.refs -= 1
            if block.refs == 0:
                self.locked_tokens -= self.block_size

    def evict(self, need_tokens: int) -> int:
        """Free at least ``need_tokens`` of unlocked leaf blocks, least recently used first; return
        the tokens freed (less when not enough is evictable)."""
        if need_tokens <= 0:
            return 0
        freed = 0
        while freed < need_tokens:
            leaves = [b for b in self._blocks.values() if b.refs == 0 and b.children == 0]
            if not leaves:
                break
            leaves.sort(key=lambda b: (b.last_use, -b.depth))
            for block in leaves:
                if freed >= need_tokens:
                    break
                self._drop(block)
                freed += self.block_size
        self.stats.evicted_tokens += freed
        return freed

    def make_room(self, need_tokens: int, capacity_tokens: int, used_tokens: int) -> bool:
        """Whether ``need_tokens`` fit in a pool of ``capacity_tokens`` of which running requests hold
        ``used_tokens`` (besides this cache's locked and evictable blocks), evicting what it must."""
        free = capacity_tokens - used_tokens - self.evictable_tokens
        if free < need_tokens:
            self.evict(need_tokens - free)
            free = capacity_tokens - used_tokens - self.evictable_tokens
        return free >= need_tokens

    def drop_adapter(self, adapter: str | None) -> None:
        """Forget every unlocked block computed under ``adapter`` (its weights are gone)."""
        for block in sorted(self._blocks.values(), key=lambda b: -b.depth):
            if block.refs == 0 and block.children == 0 and block.key == self._key(adapter, block.parent, block.tokens):
                self._drop(block)

    def _drop(self, block: Block) -> None:
        del self._blocks[block.key]
        self.cached_tokens -= self.block_size
        if block.parent is not None:
            block.parent.children -= 1
        block.payload = None

    def __len__(self) -> int:
        return len(self._blocks)
