"""The block manager: pure-Python bookkeeping of KV-cache blocks. It never touches tensors.

Invariants (checked by `check_integrity`):
- a block's ref count equals the number of requests whose block table holds it;
- the free queue holds exactly the blocks with ref count 0, allocated from the front: blocks
  that hold nothing findable first (most recently freed first), then cached blocks in LRU order;
- with prefix caching, a free block may keep its hash and stay findable until it is reused;
  such a block still counts as free capacity.
Blocks are freed in exactly one place, `free()`.

Prefix-cache keys decide whether one request may read KV that another request computed, so they
must not collide, by accident or by a search: a key is SHA-256 over a canonical encoding of the
parent key, the block's token ids and the engine's cache salt (model, dtype, quant_policy, block
size). A hit is also verified: the cached block's own token ids and parent key must equal the
request's, or it is a miss (vLLM's CVE-2025-25183 was an unverified 64-bit `hash()`).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from steadylm.engine.request import Request

BlockHash = bytes  # 32-byte SHA-256 digest


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and its tokens computed
    token_ids: tuple[int, ...] = ()  # the tokens the hash was made from (verified on a hit)
    parent_hash: BlockHash | None = None


def hash_block(
    parent_hash: BlockHash | None, token_ids: tuple[int, ...], salt: bytes = b""
) -> BlockHash:
    """Chained key: a block's identity is its tokens, every token before them, and the salt.
    Fixed-width fields (a 32-byte parent or 32 zero bytes, then the salt's length and bytes,
    then the count and 8-byte little-endian ids) make the encoding unambiguous."""
    h = hashlib.sha256()
    h.update(parent_hash if parent_hash is not None else bytes(32))
    h.update(len(salt).to_bytes(4, "little") + salt)
    ids = array("q", token_ids)  # 8-byte signed on every platform CPython supports
    if sys.byteorder == "big":
        ids.byteswap()
    h.update(len(token_ids).to_bytes(8, "little") + ids.tobytes())
    return h.digest()


def cache_salt(*parts: object) -> bytes:
    """Everything besides the tokens that changes a block's KV (model, dtype, quant_policy,
    block size, ...), folded into every block key of one engine."""
    return hashlib.sha256(repr(parts).encode("utf-8", "backslashreplace")).digest()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        watermark_blocks: int = 0,
        salt: bytes = b"",
    ) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = watermark_blocks
        self.salt = salt
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockHash, int] = {}  # block hash -> block id
        self.req_blocks: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}  # hashes of the request's full blocks
        self.hit_tokens = 0
        self.query_tokens = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def block_table(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache lookup --------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of the request's known tokens. At least one
        token is always left to compute, because the step that computes it yields the logits."""
        if not self.enable_prefix_caching or (
            request.params.prompt_logprobs is not None and request.prompt_logprobs is None
        ):
            return []  # prompt logprobs need every prompt position computed (as vLLM)
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        hits: list[int] = []
        parent: BlockHash | None = None
        for i in range(max_blocks):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            key = hash_block(parent, chunk, self.salt)
            block_id = self.cached.get(key)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != chunk or block.parent_hash != parent:
                break  # a key collision: never serve another sequence's KV
            hits.append(block_id)
            parent = key
        return hits

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup for the hit rate (tokens hit / tokens queried)."""
        if self.enable_prefix_caching:
            self.query_tokens += num_tokens
            self.hit_tokens += num_hit_tokens

    # ---- allocation: each check is paired with its action ----------------------------------
    def num_blocks_to_allocate(
        self, request: Request, num_new_tokens: int, cached_prefix: list[int] = ()
    ) -> int:
        """Free blocks that `allocate` would consume (reviving cached free blocks included)."""
        held = len(self.req_blocks.get(request.request_id, ())) + len(cached_prefix)
        computed = request.num_computed_tokens + len(cached_prefix) * self.block_size
        new = max(0, self.blocks_needed(computed + num_new_tokens) - held)
        revived = sum(1 for b in cached_prefix if self.blocks[b].ref_cnt == 0)
        return new + revived

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        cached_prefix: list[int] = (),
        keep_watermark: bool = False,
    ) -> bool:
        need = self.num_blocks_to_allocate(request, num_new_tokens, cached_prefix)
        reserve = self.watermark_blocks if keep_watermark else 0
        return need + reserve <= self.num_free_blocks

    def allocate(
        self, request: Request, num_new_tokens: int, cached_prefix: list[int] = ()
    ) -> None:
        """Give the request blocks for `num_new_tokens` more tokens. Call `can_allocate` first."""
        assert self.can_allocate(request, num_new_tokens, cached_prefix)
        table = self.req_blocks.setdefault(request.request_id, [])
        for block_id in cached_prefix:
            self._take(block_id)
            table.append(block_id)
        if cached_prefix:
            self.req_hashes[request.request_id] = [self.blocks[b].block_hash for b in cached_prefix]
        computed = request.num_computed_tokens + len(cached_prefix) * self.block_size
        for _ in range(self.blocks_needed(computed + num_new_tokens) - len(table)):
            block_id = next(iter(self.free_queue))
            self._evict(block_id)
            self._take(block_id)
            table.append(block_id)

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self.req_blocks.get(request.request_id, [])
        hashes = self.req_hashes.setdefault(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        for i in range(len(hashes), num_full):  # usually none: a block fills every bs steps
            chunk = tuple(request.token_ids(i * self.block_size, (i + 1) * self.block_size))
            parent = hashes[-1] if hashes else None
            h = hash_block(parent, chunk, self.salt)
            hashes.append(h)
            block = self.blocks[table[i]]
            if block.block_hash is None and h not in self.cached:
                block.block_hash, block.token_ids, block.parent_hash = h, chunk, parent
                self.cached[h] = block.block_id

    def free(self, request: Request, keep_tokens: int | None = None) -> int:
        """Release the request's blocks: the one place blocks are freed. With `keep_tokens`,
        only the blocks past the first `keep_tokens` tokens' (the slots of rejected draft
        tokens), which hold nothing cached. Returns the number of blocks released.

        A cached block (it has
        a hash) goes to the free queue tail, in reverse order, so a sequence's last blocks are
        evicted first. A block with nothing to find in it goes to the front and is reused next:
        on the CPU a pool page costs memory once first written, and handing new requests every
        never-used block in turn grew the server's RSS until the whole pool (4 GiB by default
        there) had been touched. Now the pages in use follow the peak number of blocks used."""
        if keep_tokens is None:
            table = self.req_blocks.pop(request.request_id, [])
            self.req_hashes.pop(request.request_id, None)
        else:
            held = self.req_blocks.get(request.request_id, [])
            keep = self.blocks_needed(keep_tokens)
            table = held[keep:]
            del held[keep:]
        for block_id in reversed(table):
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if not self.enable_prefix_caching:
                    block.block_hash, block.token_ids, block.parent_hash = None, (), None
                self.free_queue[block_id] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(block_id, last=False)
        return len(table)

    # ---- internals -----------------------------------------------------------------------
    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self.free_queue[block_id]
        block.ref_cnt += 1

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash, block.token_ids, block.parent_hash = None, (), None

    def check_integrity(self) -> None:
        """Raise AssertionError if any bookkeeping invariant is broken (tests call it)."""
        refs = [0] * self.num_blocks
        for table in self.req_blocks.values():
            assert len(set(table)) == len(table), f"duplicate block in a table: {table}"
            for block_id in table:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_cnt == refs[block.block_id], (block, refs[block.block_id])
            in_free = block.block_id in self.free_queue
            assert in_free == (block.ref_cnt == 0), (block, in_free)
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == h, (h, block_id)
        assert len(self.free_queue) + sum(r > 0 for r in refs) == self.num_blocks
        if not self.enable_prefix_caching:
            assert not self.cached
