"""Reductions: how every peer's update becomes the one update all peers apply.

* :class:`~isthmus.reduce.reducer.Reducer`: plain, compressed or robust reduction of a
  strategy's update over a :class:`~isthmus.comm.group.Group`, with staged state committed
  only when the round commits.
* :mod:`.compress`: compressors (quantization, sparsification, sign, sketches, PowerSGD) and
  their error feedback; :mod:`.aggregate`: Byzantine-robust aggregation rules and attacks.
* :mod:`.gossip`: topologies, mixing weights and exchanges for decentralized training.
* Strategies' own math as pure functions: zeroth-order (:mod:`.zo_math`, :mod:`.zo_log`),
  SparseLoCo's (:mod:`.sparseloco_math`) and DeMo's (:mod:`.demo_math`) codecs.

Pure tensor math with a small distributed interface: reduce may import comm (its ``Group``) and the
floor. Never imports checkpoint, runconfig, strategies, lab, integrations, run or cli (docs/ARCHITECTURE.md,
"Layers"; tools/structure.py checks it).
"""
