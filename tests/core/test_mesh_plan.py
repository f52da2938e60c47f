"""The mesh's plan (collectives/rendezvous/plan.py): which pairs hold a TCP link, decided once.

Links must be what the TCP algorithms use and no more: the ring's neighbours, the barrier's
rounds and recursive doubling's partners among the groups' leaders, O(log n) a leader, none
for the other ranks; every link known to both of its ends; the plan says the same to every
rank, and an error that every rank raises.
"""
from __future__ import annotations

import math

import pytest

from collectives.rendezvous import plan


def _groups(n, per_host):
    return [f"h{r // per_host}" for r in range(n)]


@pytest.mark.parametrize("n", [2, 3, 5, 7, 8, 13, 64, 100, 1000, 4096])
def test_a_leader_holds_log_n_links_known_to_both_ends(n):
    groups = _groups(n, 1)
    links = {r: set(plan.link_peers(r, groups)) for r in range(n)}
    for r, peers in links.items():
        assert r not in peers
        assert {(r + 1) % n, (r - 1) % n} <= peers  # the ring
        for p in peers:
            assert r in links[p]  # symmetric
        assert len(peers) <= 3 * math.ceil(math.log2(n)) + 1
    p2 = 1 << (n.bit_length() - 1)
    for r in range(p2):  # recursive doubling's partners and fold pairs
        k = 1
        while k < p2:
            assert r ^ k in links[r]
            k *= 2
        if r + p2 < n:
            assert r + p2 in links[r]


def test_ranks_that_lead_no_group_hold_no_link_and_leaders_link_among_themselves():
    groups = _groups(32, 4)  # 8 hosts of 4
    leaders = plan.leaders_of(groups)
    assert leaders == list(range(0, 32, 4))
    for r in range(32):
        peers = plan.link_peers(r, groups)
        assert (peers != []) == (r in leaders)
        assert set(peers) <= set(leaders)


def _entry(host, **kw):
    return {"host": host, "shm": "s", "integrity": "control", "tcp": False, "map": "", **kw}


def test_the_plan_carries_the_hosts_only_where_the_ranks_were_not_given_them():
    entries = [_entry(h) for h in ("a", "a", "b")]
    assert "hosts" in plan.make_plan(entries)
    digest = plan.map_digest(["a", "a", "b"])
    given = plan.make_plan([dict(e, map=digest) for e in entries])
    assert "hosts" not in given and "groups" not in given


def test_a_host_split_by_its_dev_shm_is_in_the_plan():
    entries = [_entry("a", shm="x"), _entry("a", shm="y"), _entry("b")]
    p = plan.make_plan(entries)
    groups = plan.groups_of(p, ["a", "a", "b"])
    assert len(set(groups)) == 3 and plan.leaders_of(groups) == [0, 1, 2]


def test_ranks_that_disagree_on_the_mode_get_one_error_naming_each():
    entries = [_entry("a"), _entry("b", integrity="payload")]
    with pytest.raises(plan.PlanError, match="rank 0: control, rank 1: payload"):
        plan.make_plan(entries)
    with pytest.raises(plan.PlanError, match="HOROVOD_SPARK_FORCE_TCP: rank 0: 0, rank 1: 1"):
        plan.make_plan([_entry("a"), _entry("b", tcp=True)])
