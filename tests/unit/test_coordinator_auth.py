"""Join tokens, identities, revocation and the dashboard's per-identity cookie (pure)."""

from __future__ import annotations

import pytest

from isthmus.coordinator.auth import ADMIN, Identities, Identity, join_token, parse_join_token

ADMIN_TOKEN = "the-operator-secret"


def test_a_join_token_proves_its_name_and_only_under_its_admin_token() -> None:
    ids = Identities(ADMIN_TOKEN)
    tok = join_token(ADMIN_TOKEN, "alice")
    assert tok.startswith("ij1.alice.")
    assert ids.check(tok) == Identity("alice", False)
    assert ids.check(ADMIN_TOKEN) == Identity(ADMIN, True)
    # the same name under another admin token, a tampered name or mac: refused alike
    assert ids.check(join_token("another-secret", "alice")) == "invalid token for this run"
    forged = tok.replace("ij1.alice.", "ij1.mallory.")
    assert ids.check(forged) == "invalid token for this run"
    assert ids.check(tok[:-1] + ("0" if tok[-1] != "0" else "1")) == "invalid token for this run"
    assert "missing token" in str(ids.check(""))
    assert parse_join_token("ij1.a.b.c") is None


def test_revoking_refuses_the_token_and_names_its_peers() -> None:
    ids = Identities(ADMIN_TOKEN)
    alice, bob = join_token(ADMIN_TOKEN, "alice"), join_token(ADMIN_TOKEN, "bob")
    ids.bind(3, Identity("alice", False))
    ids.bind(4, Identity("bob", False))
    ids.bind(5, Identity("alice", False))
    cookie = ids.cookie_for(alice)
    assert cookie is not None and ids.cookie_ok(cookie)
    assert ids.revoke("alice") == [3, 5]
    assert "revoked" in str(ids.check(alice))
    assert not ids.token_ok(alice) and ids.token_ok(bob) and ids.token_ok(ADMIN_TOKEN)
    assert not ids.cookie_ok(cookie), "a revoked identity's dashboard session ends too"
    with pytest.raises(ValueError, match="admin"):
        ids.revoke(ADMIN)
    # revocations given at start (a restarted coordinator)
    assert not Identities(ADMIN_TOKEN, revoked=("bob",)).token_ok(bob)


def test_a_join_token_acts_only_for_its_own_peers_and_the_admin_for_all() -> None:
    ids = Identities(ADMIN_TOKEN)
    alice, bob = Identity("alice", False), Identity("bob", False)
    ids.bind(1, alice)
    assert ids.may_act_for(alice, 1)
    assert not ids.may_act_for(bob, 1)
    assert not ids.may_act_for(alice, 2), "an unregistered id belongs to nobody"
    assert ids.may_act_for(Identity(ADMIN, True), 1)
    ids.forget({2})
    assert not ids.may_act_for(alice, 1)


def test_the_peers_of_a_name_follow_binds_and_forgets() -> None:
    ids = Identities(ADMIN_TOKEN)
    alice, bob = Identity("alice", False), Identity("bob", False)
    for pid, who in [(7, alice), (2, bob), (4, alice), (9, alice)]:
        ids.bind(pid, who)
    assert (ids.peers_of("alice"), ids.peers_of("bob"), ids.peers_of("carol")) == (
        [4, 7, 9],
        [2],
        [],
    )
    ids.forget({2, 9})
    assert (ids.peers_of("alice"), ids.peers_of("bob")) == ([9], [2])
    assert ids.peers_of("alice") == [p for p, n in ids.owner.items() if n == "alice"]


@pytest.mark.parametrize("name", ["", "admin", ".x", "a b", "x" * 65, "é"])
def test_bad_names_are_refused_with_the_rule(name: str) -> None:
    with pytest.raises(ValueError, match="letters, digits"):
        join_token(ADMIN_TOKEN, name)


def test_a_cookie_cannot_be_forged_for_another_name() -> None:
    ids = Identities(ADMIN_TOKEN)
    cookie = ids.cookie_for(join_token(ADMIN_TOKEN, "alice"))
    assert cookie is not None
    mac = cookie.rpartition(".")[2]
    assert not ids.cookie_ok(f"admin.{mac}")
    assert ids.cookie_for("wrong") is None
