"""The coordinator's membership logic alone, in one process (no HTTP, no heartbeats): CPU time of
``Membership.tick`` while a round of ``--peers`` members runs, and of one round's begins (32
hashes each, parity every round; with ``--parity-every K`` hashes only in the begins of every
K-th round, as peers send them), formation and commits, over ``--rounds`` rounds. With
``--digest`` the begins after the first carry the digest of their hashes in place of the list
(``Begin.digest``, as peers send them to a coordinator that lists ``hash-digest``; a source tree
without it refuses the flag).

    python benchmarks/membership_logic.py [--peers 1000] [--rounds 5] [--ticks 50] [--parity-every 1]
        [--digest]

What ``coordinator_scale.py`` measures minus the transport: the part of a round's coordinator
CPU that the membership's own code costs.
"""

from __future__ import annotations

import argparse
import time

from coordinator_scale import _light_import

_light_import()

from isthmus.coordinator.membership import Membership, MembershipConfig  # noqa: E402
from isthmus.coordinator.protocol import TensorSpec  # noqa: E402

TENSORS = 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ticks", type=int, default=50)
    ap.add_argument("--parity-every", type=int, default=1)
    ap.add_argument("--digest", action="store_true", help="begins carry the hashes' digest")
    a = ap.parse_args()
    schema = [TensorSpec(f"layers.{i}.weight", (64, 64), "float32") for i in range(TENSORS)]
    hashes = {f"layers.{i}.weight": f"{i * 7919:016x}" for i in range(TENSORS)}
    digest = ""
    if a.digest:
        from isthmus.coordinator.parity import state_digest

        digest = state_digest(hashes)
    cfg = MembershipConfig(start_peers=a.peers, heartbeat_timeout=5.0, parity_every=a.parity_every)
    m = Membership(cfg)
    pids = [m.register(f"p{i:05d}", 0.0) for i in range(a.peers)]
    for p in pids:  # the first round (not counted: before the run starts, every begin looks)
        m.begin(p, 0.0, nonce="a", revision=0, hashes=hashes, schema=schema, explain=False)
    t0 = time.process_time()
    for _ in range(a.ticks):
        m.tick(0.5)
    t1 = time.process_time()
    plan = m.running
    assert plan is not None and len(plan.members) == a.peers
    for rnd in range(a.rounds + 1):
        if rnd == 1:
            t2 = time.process_time()
        for p in pids:
            m.commit(p, 0.5, epoch=plan.epoch, round=plan.round, ok=True, explain=False)
        if rnd == a.rounds:
            break
        sent = hashes if (rnd + 1) % a.parity_every == 0 else None
        extra = {"digest": digest} if a.digest and sent is not None else {}
        if extra:
            sent = None
        for p in pids:
            m.begin(
                p,
                0.5,
                nonce=f"n{rnd}",
                revision=rnd + 1,
                hashes=sent,
                schema=None,
                explain=False,
                **extra,
            )
        plan = m.running
        assert plan is not None and len(plan.members) == a.peers
    t3 = time.process_time()
    print(
        f"{a.peers} members, parity every {a.parity_every}{', digests' if a.digest else ''}: tick during a round {1e3 * (t1 - t0) / a.ticks:.2f} ms; "
        f"begins + formation + commits per round {1e3 * (t3 - t2) / a.rounds:.1f} ms"
    )


if __name__ == "__main__":
    main()
