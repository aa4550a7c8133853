"""The lab: runs on an emulated wide-area network, and the tools that judge and predict them.

* The emulated WAN: network namespaces (:mod:`.netns`), the network built in them
  (:mod:`.wan`, :mod:`.build`), delay lines for latency, jitter and loss (:mod:`.delayline`,
  :mod:`.lines`), link rates (:mod:`.rates`), interface counters (:mod:`.counters`) and their
  sampling during a run (:mod:`.links`).
* Scenario files: a run, its network and its faults in one TOML file (:mod:`.scenario`,
  :mod:`.netspec`, :mod:`.checks`).
* Churn as a pure schedule (:mod:`.churn_plan`); ``isthmus.run.churn_hook`` carries it out.
* Measuring and predicting: the all-reduce bench (:mod:`.bench`), a link's fidelity
  (:mod:`.fidelity`, with :mod:`.linkprobe` run inside the namespaces), and the analytic
  simulator (:mod:`.sim`).

A lab run itself is started by ``isthmus.run.lab_run`` through the one launcher. lab may import
strategies, checkpoint, reduce, comm, the coordinator and the floor. Never imports run or cli
(docs/ARCHITECTURE.md, "Layers"; tools/structure.py checks it).
"""
