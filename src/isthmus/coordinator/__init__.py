"""The coordinator: the one process that knows who is in a run, and the peers' way to reach it.

* The membership state machine, pure (no sockets, no clock of its own): who is a member, when a
  round forms, commits or aborts, which peers must be repaired from whom, which checkpoint is
  the latest complete one, the ring order and the stragglers.
* The wire types both sides share, the HTTP server and its heartbeat websocket, and the
  peer-side client with bounded retries.
* Access: tokens and join identities, revocation, per-client limits, TLS, and the authenticated
  rendezvous store through which process groups meet (docs/SECURITY.md).
* :mod:`.web`: the live dashboard and ``/metrics``.

The coordinator never sees a tensor, only names, shapes and hashes. It sits just above the floor
and may import spec, data and models. Never imports comm, testing, reduce, checkpoint,
strategies, lab, run or cli (docs/ARCHITECTURE.md, "Layers"; tools/structure.py checks it).
"""
