"""The peer side of a run: what each training process uses to take part in it.

* :class:`~isthmus.comm.session.Session`: registers with the coordinator, keeps a heartbeat and
  runs rounds that commit on every member or on none, with parity checks and resync; its
  settings and errors are :mod:`.session_config`.
* :class:`~isthmus.comm.group.Group`: one epoch's torch process group, with bounded, abortable
  collectives and byte accounting (:mod:`.accounting`); connecting an epoch's groups and cutting
  them on abort (:mod:`.epoch`, :mod:`.connect`, :mod:`.stripes`, :mod:`.wires`).
* Shared state, the named tensors every in-sync peer holds bit-identical (:mod:`.state`), and
  their verified transfer to the peers that need them (:mod:`.transfer`).
* Link probes (:mod:`.probe`, its pure part :mod:`.probe_math`), fault injection
  (:mod:`.faults`), the warning when Gloo traffic would cross a public network (:mod:`.exposure`).

comm moves named tensors and never knows what a model is. It may import the coordinator (its client
and wire types) and the floor (spec, data, models). Never imports reduce, testing, checkpoint,
runconfig, strategies, lab, integrations, run or cli (docs/ARCHITECTURE.md, "Layers"; tools/structure.py checks
it).
"""
