"""The host side of the paged KV cache (model/pages.py): reference counts, the LRU of cached pages and
the chained prefix keys. Pure Python, no jax."""

from __future__ import annotations

import pytest

from model.pages import ROOT_DIGEST, PagePool, chain_digest, page_digests


def _accounted(pool: PagePool) -> None:
    assert pool.used + pool.available() == pool.n_pages
    assert 0 <= pool.cached <= pool.available()


def test_take_and_release_count_references():
    pool = PagePool(4, 16)
    a = pool.take(3)
    assert sorted(a) == [0, 1, 2] and (pool.used, pool.available(), pool.cached) == (3, 1, 0)
    assert pool.take(2) is None and pool.available() == 1  # refused whole: nothing taken
    [b] = pool.take(1)
    assert b == 3 and pool.available() == 0
    pool.release(a)
    assert (pool.used, pool.available(), pool.cached) == (1, 3, 0)  # unkeyed pages go back to the free list
    pool.release([b])
    assert pool.used == 0
    with pytest.raises(AssertionError, match="released more often"):
        pool.release([b])
    _accounted(pool)


def test_a_shared_page_is_freed_by_its_last_holder():
    pool = PagePool(2, 4)
    [p] = pool.take(1)
    d = chain_digest(ROOT_DIGEST, [1, 2, 3, 4])
    pool.publish(p, d)
    assert pool.match([d], 4) == [p]  # a second holder
    pool.release([p])
    assert (pool.used, pool.cached) == (1, 0)  # still held once
    pool.release([p])
    assert (pool.used, pool.cached) == (0, 1)  # nobody holds it: cached, not free
    _accounted(pool)


def test_take_evicts_the_least_recently_released_cached_page_and_forgets_its_key():
    pool = PagePool(3, 2)
    pages = pool.take(3)
    digests = page_digests([1, 2, 3, 4, 5, 6], 2)
    for page, digest in zip(pages, digests, strict=True):
        pool.publish(page, digest)
    # released in the order 2, 0, 1: page 2 is the least recently used
    for page in (pages[2], pages[0], pages[1]):
        pool.release([page])
    assert (pool.cached, pool.available()) == (3, 3)
    assert pool.take(1) == [pages[2]]
    assert pool.cached == 2
    assert pool.match([digests[2]], 2) == []  # its key is gone with it
    assert pool.match(digests[:1], 2) == [pages[0]]  # the others still serve
    pool.release([pages[0]])  # now page 0 is the most recently released: page 1 goes next
    assert pool.take(1) == [pages[1]]
    assert pool.match(digests[1:2], 2) == []
    _accounted(pool)


def test_free_pages_go_before_any_cached_page():
    pool = PagePool(3, 2)
    [keyed] = pool.take(1)
    pool.publish(keyed, chain_digest(ROOT_DIGEST, [7, 7]))
    pool.release([keyed])
    got = pool.take(2)
    assert keyed not in got and pool.cached == 1  # the never-keyed ones first
    assert pool.take(1) == [keyed] and pool.cached == 0


def test_match_takes_the_longest_chain_only():
    pool = PagePool(8, 2)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    digests = page_digests(tokens, 2)
    pages = pool.take(4)
    for i in (0, 1, 3):  # page 2 never published: the chain breaks there
        pool.publish(pages[i], digests[i])
    pool.release(pages)
    before = pool.cached
    got = pool.match(digests, len(tokens))
    assert got == pages[:2]  # page 3 is cached, but after the break: not taken
    assert pool.cached == before - 2 and pool.used == 2
    assert (pool.queries_tokens, pool.hits_tokens) == (8, 4)
    assert pool.match([chain_digest(ROOT_DIGEST, [9, 9]), *digests], 8) == []  # broken at the first page
    assert (pool.queries_tokens, pool.hits_tokens) == (16, 4)
    _accounted(pool)


def test_unmatch_restores_the_counts():
    pool = PagePool(4, 2)
    digests = page_digests([1, 2, 3, 4], 2)
    pages = pool.take(2)
    for page, digest in zip(pages, digests, strict=True):
        pool.publish(page, digest)
    pool.release(pages)
    state = (pool.used, pool.available(), pool.cached, pool.queries_tokens, pool.hits_tokens)
    got = pool.match(digests, 5)
    assert got == pages and pool.used == 2
    pool.unmatch(got, 5)
    assert (pool.used, pool.available(), pool.cached, pool.queries_tokens, pool.hits_tokens) == state
    assert pool.match(digests, 5) == pages  # still cached, still keyed


def test_publish_of_a_digest_already_cached_keeps_the_first_page():
    pool = PagePool(4, 2)
    d = chain_digest(ROOT_DIGEST, [3, 3])
    first, second = pool.take(2)
    pool.publish(first, d)
    pool.publish(second, d)  # two sequences computed the same page at once
    pool.release([first, second])
    assert pool.cached == 1  # the duplicate went back to the free list, unkeyed
    assert pool.match([d], 2) == [first]
    pool.publish(first, chain_digest(ROOT_DIGEST, [4, 4]))  # a keyed page keeps its key
    pool.release([first])
    assert pool.match([d], 2) == [first]


def test_clear_forgets_everything_but_the_cumulative_counters():
    pool = PagePool(4, 2)
    digests = page_digests([1, 2, 3, 4], 2)
    pages = pool.take(3)
    for page, digest in zip(pages, digests, strict=False):
        pool.publish(page, digest)
    pool.release(pages[:1])
    pool.match(digests, 4)
    counts = (pool.queries_tokens, pool.hits_tokens)
    assert counts == (4, 4)
    pool.clear()
    assert (pool.used, pool.available(), pool.cached) == (0, 4, 0)
    assert (pool.queries_tokens, pool.hits_tokens) == counts
    assert pool.match(digests, 4) == []
    assert sorted(pool.take(4)) == [0, 1, 2, 3]


def test_chain_digest_names_every_earlier_token():
    page = [5, 6, 7, 8]
    a = page_digests([1, 2, 3, 4, *page], 4)
    b = page_digests([1, 2, 3, 9, *page], 4)  # the same second page after a different first one
    assert a[0] != b[0] and a[1] != b[1]
    assert a == page_digests([1, 2, 3, 4, *page, 10, 11], 4)  # a partial last page has no key
    assert a[1] == chain_digest(a[0], page) and a[0] == chain_digest(ROOT_DIGEST, [1, 2, 3, 4])
    assert chain_digest(ROOT_DIGEST, [1, 2]) != chain_digest(ROOT_DIGEST, [2, 1])
    assert chain_digest(ROOT_DIGEST, [256]) != chain_digest(ROOT_DIGEST, [1, 0])  # token ids, not bytes
    assert page_digests([1, 2, 3], 4) == []


def test_a_pool_needs_pages():
    with pytest.raises(ValueError, match="needs pages"):
        PagePool(0, 16)
