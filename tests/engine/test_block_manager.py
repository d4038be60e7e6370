"""Block manager with tiny pools: exact block ids, ref counts, freeing, prefix-cache hashes."""

from __future__ import annotations

import pytest

from steadylm.engine.block_manager import BlockManager, hash_block
from steadylm.engine.request import Request, SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_new_tokens=8))


def test_allocate_exact_ids_and_free_order():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = req("a", list(range(9))), req("b", list(range(3)))
    assert bm.num_blocks_to_allocate(a, 9) == 3
    bm.allocate(a, 9)
    bm.allocate(b, 3)
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.block_table("b") == [3]
    assert bm.num_free_blocks == 2
    bm.check_integrity()
    bm.free(a)
    # Nothing cached in them: freed to the queue front and reused first, before 4 and 5 are
    # ever touched (on the CPU an untouched block costs no memory).
    assert list(bm.free_queue) == [0, 1, 2, 4, 5]
    bm.check_integrity()
    c = req("c", list(range(12)))
    bm.allocate(c, 12)
    assert bm.block_table("c") == [0, 1, 2]
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == 6
    bm.check_integrity()


def test_freed_blocks_are_reused_before_untouched_ones():
    """The blocks ever handed out follow the peak in use, not the pool size: on the CPU each
    never-used block handed out is memory the process gains for good."""
    for prefix_caching in (False, True):
        bm = BlockManager(num_blocks=100, block_size=4, enable_prefix_caching=prefix_caching)
        ever: set[int] = set()
        for i in range(300):
            r = req(f"r{i}", list(range(1 + i % 10)))
            bm.allocate(r, r.num_tokens)
            ever.update(bm.block_table(r.request_id))
            bm.free(r)
        assert ever == {0, 1, 2}  # one request of up to 10 tokens at a time: 3 blocks
        bm.check_integrity()


def test_growth_allocates_one_block_per_boundary():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = req("a", [1, 2, 3, 4])
    bm.allocate(a, 4)
    a.num_computed_tokens = 4
    a.append_output(9)
    assert bm.num_blocks_to_allocate(a, 1) == 1
    bm.allocate(a, 1)
    assert bm.block_table("a") == [0, 1]
    a.num_computed_tokens = 5
    a.append_output(9)
    assert bm.num_blocks_to_allocate(a, 1) == 0


def test_can_allocate_refuses_without_changing_state():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = req("a", list(range(12)))
    assert not bm.can_allocate(a, 12)
    assert bm.num_free_blocks == 2 and not bm.req_blocks
    bm.check_integrity()


def test_watermark_applies_only_when_asked():
    bm = BlockManager(num_blocks=4, block_size=4, watermark_blocks=1)
    a = req("a", list(range(16)))
    assert bm.can_allocate(a, 16)
    assert not bm.can_allocate(a, 16, keep_watermark=True)


def test_prefix_cache_shares_blocks_by_ref_count():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    shared = list(range(10, 18))  # two full blocks
    a = req("a", shared + [1, 2])
    bm.allocate(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    bm.cache_full_blocks(a)
    assert len(bm.cached) == 2
    b = req("b", shared + [7])
    hits = bm.find_cached_prefix(b)
    assert hits == bm.block_table("a")[:2]
    bm.allocate(b, 1, hits)
    assert bm.blocks[hits[0]].ref_cnt == 2
    bm.check_integrity()
    bm.free(a)
    assert bm.blocks[hits[0]].ref_cnt == 1
    bm.free(b)
    # Freed, but still findable: cached blocks count as free capacity.
    assert bm.num_free_blocks == 8
    assert bm.find_cached_prefix(req("c", shared + [5])) == hits
    bm.check_integrity()


def test_prefix_hit_never_covers_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = req("a", list(range(8)))
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    assert len(bm.find_cached_prefix(req("b", list(range(8))))) == 1


def test_eviction_reuses_lru_cached_block_and_drops_its_hash():
    bm = BlockManager(num_blocks=2, block_size=2, enable_prefix_caching=True)
    a = req("a", [1, 2, 3])
    bm.allocate(a, 3)
    a.num_computed_tokens = 3
    bm.cache_full_blocks(a)
    h = hash_block(None, (1, 2))
    assert bm.cached == {h: 0}
    bm.free(a)
    b = req("b", [9, 9, 9, 9])
    bm.allocate(b, 4)  # needs both blocks: evicts the cached one
    assert h not in bm.cached
    bm.check_integrity()


def test_integrity_check_detects_corruption():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = req("a", [1, 2])
    bm.allocate(a, 2)
    bm.blocks[0].ref_cnt = 5
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_token_ids_slices_across_prompt_and_output():
    r = req("t", [1, 2, 3])
    r.output_token_ids += [4, 5]
    for start in range(6):
        for end in range(start, 6):
            assert r.token_ids(start, end) == r.all_token_ids[start:end]


def test_block_keys_are_sha256_of_a_canonical_encoding():
    """Keys are 32-byte digests, the same in every process (not Python's seeded hash()), and
    every input changes them: parent, tokens, token order, block boundaries and the salt."""
    import hashlib
    from array import array

    key = hash_block(None, (1, 2), b"s")
    assert isinstance(key, bytes) and len(key) == 32
    expected = hashlib.sha256(
        bytes(32)
        + (1).to_bytes(4, "little")
        + b"s"
        + (2).to_bytes(8, "little")
        + array("q", [1, 2]).tobytes()
    ).digest()
    assert key == expected
    variants = {
        hash_block(None, (1, 2), b"s"),
        hash_block(key, (1, 2), b"s"),
        hash_block(None, (2, 1), b"s"),
        hash_block(None, (1, 2, 0), b"s"),
        hash_block(None, (1, 2), b"t"),
        hash_block(None, (1, 2 + 2**32), b"s"),  # no truncation of large ids
    }
    assert len(variants) == 6


def test_a_colliding_key_is_never_served_as_a_hit(monkeypatch):
    """Even if two blocks' keys collided, a hit is verified against the cached block's own
    tokens and parent, so another sequence's KV is never read."""
    from steadylm.engine import block_manager as bm_mod

    monkeypatch.setattr(bm_mod, "hash_block", lambda parent, tokens, salt=b"": b"\0" * 32)
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a = req("a", [1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    assert bm.find_cached_prefix(req("same", [1, 2, 3])) == [0]
    assert bm.find_cached_prefix(req("other", [7, 8, 3])) == []  # same key, other tokens
    bm.check_integrity()


def test_salt_separates_engines():
    """A block cached under one salt (model, dtype, quant_policy, block size) is not a hit
    under another."""
    a, b = (BlockManager(4, 2, enable_prefix_caching=True, salt=s) for s in (b"x", b"y"))
    r = req("a", [1, 2, 3])
    a.allocate(r, 3)
    r.num_computed_tokens = 3
    a.cache_full_blocks(r)
    assert set(a.cached) != {hash_block(None, (1, 2), b"y")}
    assert a.find_cached_prefix(req("q", [1, 2, 3])) == [0]
    assert b.find_cached_prefix(req("q", [1, 2, 3])) == []
