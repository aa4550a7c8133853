"""Decentralized training by gossip: peers average with graph neighbours, never all at once.

* D-PSGD: Lian, Zhang, Zhang, Hsieh, Zhang and Liu, "Can Decentralized Algorithms Outperform
  Centralized Algorithms? A Case Study for Decentralized Parallel Stochastic Gradient Descent",
  NeurIPS 2017 (arXiv 1705.09056): each peer takes a local optimizer step, then replaces its
  parameters by a Metropolis-Hastings weighted average of its own and its neighbours'
  (Xiao and Boyd 2004). No peer ever waits for all the others' data.
* Communication schedules, after "A Single Merging Suffices: Recovering Server-based Learning
  Performance in Decentralized Learning" (Zhu et al., 2025): gossip after every ``k`` steps
  (``constant``), more and more often toward the end (``late_heavy``), or never, with one exact
  global average at the end (``single_merge``). Every schedule ends on an exact global merge by
  default, which is also what makes the peers' models bit-identical at the end.
* Variance-corrected averaging, "Vanishing Variance Problem in Fully Decentralized
  Neural-Network Systems" (arXiv 2404.04616): after mixing, each layer is rescaled to the
  variance of the received models (useful when peers start from different initializations).
* DFedSAM, "Improving the Model Consistency of Decentralized Federated Learning" (Shi et al.,
  ICML 2023): sharpness-aware local steps (Foret et al., ICLR 2021) and ``Q`` gossip iterations
  per round (DFedSAM-MGS).
* MoDeST, "MoDeST: Bridging the Gap between Federated and Decentralized Learning with
  Decentralized Sampling" (de Vos et al., 2023): each round a seeded sample of trainers sends
  its models to a seeded sample of aggregators, who average them and hand the result to
  everyone.
* Consensus distance, "Consensus Control for Decentralized Deep Learning" (Kong et al., ICML
  2021): the mean distance of the peers' parameters from their average, reported as a metric.
* Compressed gossip, "Decentralized Stochastic Optimization and Gossip Algorithms with
  Compressed Communication" (CHOCO, Koloskova, Stich and Jaggi, ICML 2019): with a quantizer
  (``--compression int8``), messages are quantized and mixed in difference form so the mean of
  the models survives the quantization error.
* Topologies and their behaviour when peers drop out: see
  :mod:`isthmus.strategies.gossip.math.topology` and "Exploring the Impact of Disrupted Peer-to-Peer Communications on Fully Decentralized
  Learning in Disaster Scenarios" (2023).

How it runs on isthmus's rounds (docs/GOSSIP.md has the long form):

* **Shared state is only what is identical**: the step counter, plus the graph in repair mode
  and MoDeST's last aggregate and trainer list, plus the model's frozen parameters and integer
  buffers (``model/<name>``: nothing changes them but the forward passes every peer runs alike;
  the parity check repairs a peer that differs and a joiner receives them). The trainable
  parameters are *not* shared state: during gossip they legitimately differ between peers, and
  registering them would make the session "repair" every peer to the majority each round.
* **Buffers**: the floating ones (BatchNorm's running statistics) are mixed like parameters:
  they follow the parameters in the flat vector every exchange mixes (with variance correction,
  each is rescaled like a layer), so the final merge averages them exactly and every peer ends
  with the same ones. Integer buffers are shared state (above).
* **Rounds.** Each exchange (a gossip round, a merge, a MoDeST round) is one session round.
  Steps without communication need no round; every peer increments the step counter after each
  local step, and since the schedule is a pure function of ``(step, total_steps)`` all peers
  reach the same round at the same counter value, so the counter is identical whenever it is
  hashed (at a round's start). A round's result is applied only after the round committed; if a
  peer dies mid-exchange, the round aborts for everyone, the survivors form a new epoch, the
  graph is rebuilt over the new member list and the exchange is retried from the unchanged
  parameters.
* **Every round starts with a tiny all-gather** of ``[usable, trained, step, kind, iterations]``
  per peer: it tells everyone which peers hold a usable model (not a joiner, not stale, finite)
  and checks that they agree on the step counter and on what the round does.
* **The graph** is derived identically on every peer from ``(topology spec, seed, member list)``
  of the round (regenerate mode), or from the shared previous graph and the member list (repair
  mode); see :class:`isthmus.strategies.gossip.math.PeerGraph`. A split graph is reported in the
  logs and metrics.
* **Joiners and stale peers.** A peer's first ``step()`` is a round (its gradient is dropped).
  At the start of a run that round broadcasts rank 0's initial model (``initial_sync``). A
  joiner instead waits for the members' next round, receives the step counter through the
  session's resync, mixes nothing, and leaves the round with an exact copy of an up-to-date
  peer's freshly mixed parameters (round robin over the usable peers). A peer whose parameters
  went non-finite is treated the same way (logged, counted in ``nonfinite_skips``).
* **Parity.** Only after the final merge (an exact all-reduce average, bitwise identical on
  every rank, copied into the parameters) do peers hold the same model; the demo's summary and
  the tests compare ``model_digest`` then. Without ``final_merge`` the models stay different.

This package belongs to the strategies' layer: it may import reduce (:mod:`isthmus.reduce.gossip`
holds its math), comm and the floor. Never imports lab, integrations, run or cli (docs/ARCHITECTURE.md,
"Layers"; tools/structure.py checks it).
"""

from isthmus.strategies.gossip.options import GossipConfig
from isthmus.strategies.gossip.strategy import Gossip

__all__ = ["Gossip", "GossipConfig"]
