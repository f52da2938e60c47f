"""The engine's agreement logic on its own: response cache, message table, vector layout.

These parts must compute identical outcomes on every rank from identical
inputs; here they run in one process, fed what the ranks would exchange.
"""
from __future__ import annotations


from collectives.fusion import coordinator as C
from collectives.fusion.cache import ResponseCache
from collectives.fusion.request import Signature
from collectives.fusion.table import MessageTable
from collectives.types import DType, ReduceOp


def sig(name, n=4, dtype=DType.FLOAT32, op=ReduceOp.SUM):
    return Signature(name, "allreduce", int(dtype), (n,), int(op), 0, 1.0, 1.0)


def test_the_cache_gives_bits_in_order_and_reuses_the_lowest_free_bit():
    cache = ResponseCache(capacity=8)
    for name in "abc":
        cache.put(sig(name))
    assert [cache.bit(sig(n)) for n in "abc"] == [0, 1, 2]
    cache.evict("a")
    cache.put(sig("d"))
    assert cache.bit(sig("d")) == 0 and len(cache) == 3


def test_a_new_signature_for_a_cached_name_replaces_the_old_one():
    cache = ResponseCache()
    cache.put(sig("w", 4))
    cache.put(sig("w", 5))
    assert cache.bit(sig("w", 4)) is None and cache.by_name("w") == sig("w", 5)


def test_a_full_cache_evicts_the_least_recently_used_entry():
    cache = ResponseCache(capacity=3)
    for name in "abc":
        cache.put(sig(name))
    cache.at(cache.bit(sig("a")))  # 'a' was just used: 'b' is now the oldest
    cache.put(sig("d"))
    assert cache.bit(sig("b")) is None and len(cache) == 3
    assert {cache.by_name(n) for n in "acd"} == {sig("a"), sig("c"), sig("d")}


def test_the_cache_reports_only_the_bits_that_changed():
    """What the lane's slots go stale by: a put and an eviction name their bits, and the
    bits of the other entries never move."""
    cache = ResponseCache(capacity=3)
    for name in "abc":
        cache.put(sig(name))
    assert cache.take_changed() == [0, 1, 2] and cache.take_changed() == []
    cache.put(sig("b", 5))  # a new shape for 'b': its bit is freed and given again
    assert cache.take_changed() == [1] and cache.bit(sig("b", 5)) == 1
    cache.at(cache.bit(sig("b", 5)))
    cache.at(cache.bit(sig("c")))
    cache.put(sig("d"))  # full: 'a', the least recently used, gives up bit 0
    assert cache.take_changed() == [0] and cache.bit(sig("d")) == 0
    assert [cache.bit(s) for s in (sig("b", 5), sig("c"))] == [1, 2]


def test_the_table_agrees_once_every_active_rank_announced():
    table = MessageTable(3)
    table.add(0, sig("x"))
    table.add(2, sig("x"))
    assert table.resolve((False,) * 3) == ([], [])
    assert table.resolve((False, True, False)) == ([sig("x")], [])  # rank 1 joined: zeros


def test_the_table_reports_a_mismatch_with_every_ranks_signature():
    table = MessageTable(3)
    for r, s in enumerate([sig("x", 4), sig("x", 5), sig("x", 4)]):
        table.add(r, s)
    ready, errors = table.resolve((False,) * 3)
    (name, text, ranks), = errors
    assert ready == [] and name == "x" and ranks == [0, 1, 2]
    assert "ranks 0,2: allreduce float32[4]" in text and "rank 1: allreduce float32[5]" in text


def test_a_late_rank_gets_the_mismatch_at_once():
    table = MessageTable(3)
    table.add(0, sig("x", 4))
    table.add(1, sig("x", 5))
    table.resolve((False,) * 3)
    assert "ranks disagree on tensor 'x'" in table.add(2, sig("x", 4))
    table.add(2, sig("x", 4))  # everyone was told: the name is free again
    assert "x" in table


def test_the_vector_sums_to_ready_bits_joined_ranks_and_announcements():
    layout = C.Layout(2)
    a = layout.vector(0, 3, stall=False, joined=False, shutdown=False, announce=10)
    a[layout.bits + 0] = C.DATA
    a[layout.bits + 2] = C.DATA
    b = layout.vector(1, 3, stall=True, joined=True, shutdown=False, announce=0)
    b[layout.bits + 2] = C.DATA  # joined, but holding real data for bit 2
    res = layout.parse(a + b)
    assert res.ready_bits == [0, 2] and res.joined == (False, True) and res.stall
    assert res.announce == (10, 0) and res.negotiate and res.active
    only_joined = layout.parse(layout.vector(0, 1, stall=False, joined=True, shutdown=True,
                                             announce=0) * 2)
    assert only_joined.ready_bits == [] and only_joined.shutdown == (0,)


def test_signatures_survive_the_json_round_trip():
    s = Signature("g", "allgather", int(DType.BFLOAT16), (-1, 3), 0, 0, 1.0, 1.0)
    assert Signature.from_json(__import__("json").loads(C.encode([s]))[0]) == s
    strict = s._replace(strict_join=True)
    assert Signature.from_json(__import__("json").loads(C.encode([strict]))[0]) == strict
    assert s.tensor() == "'g' bfloat16[*,3]"
