"""The coordinator: one process that keeps a run's membership, and the peer's client of it.

What it holds, lowest first:

* the rules, pure (values in, values out, a clock passed in): :mod:`.peers` (each peer and the
  run's rules), :mod:`.phase` (the run's phase and its legal moves), :mod:`.record` (events,
  counters, pushes), :mod:`.parity` (the vote on the state), :mod:`.ring` (ring order),
  :mod:`.state`, :mod:`.forming` and :mod:`.membership` (the state machine of rounds),
  :mod:`.checkpoints`, :mod:`.stragglers`, :mod:`.auth` (tokens and identities) and
  :mod:`.limits`; :mod:`.protocol` holds the wire types;
* the server's rooms, each talking to the shared :mod:`.hub` through its public methods:
  :mod:`.gate` (authentication and limits), :mod:`.admin` (the operator's API),
  :mod:`.store_service` (the rendezvous store), :mod:`.web` (dashboard and ``/metrics``);
  :mod:`.server` wires them into the :class:`~.server.Coordinator`, configured by
  :mod:`.server_config`; :mod:`.tls` makes and pins certificates;
* the peer's side: :mod:`.client` and :mod:`.store_client`.

It never sees a tensor, only names, shapes and hashes. It sits just above the floor and may import
spec, data and models. Never imports comm, reduce, testing, checkpoint, runconfig, strategies, lab, integrations,
run or cli (docs/ARCHITECTURE.md, "Layers"; tools/structure.py checks it). Inside it, no module
reaches into another's private members, and no two modules import each other. This file imports
nothing, so ``import isthmus.coordinator.protocol`` stays light.
"""
