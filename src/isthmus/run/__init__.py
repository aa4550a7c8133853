"""The one way to start and describe a run.

* :class:`RunConfig` (:mod:`.config`, its flags :mod:`.flags`): one typed config, every
  default once.
* Starting peers: the launcher (:mod:`.launch`) runs a :class:`~isthmus.run.programs.Program`
  (:mod:`.programs`) in every peer slot, forked from a warm server (:mod:`.forkserver`). Three
  drivers build a launch: :mod:`.builtin_run` (the built-in job on local peers: ``isthmus
  demo``), :mod:`.script_run` (the user's script: ``isthmus run``) and :mod:`.lab_run`
  (``isthmus lab run``); :mod:`.job` is the built-in job itself, the code inside each of its
  peer processes. Planned churn (:mod:`.churn_hook`), the embedded coordinator's TLS
  (:mod:`.secure`), the fine-tuning starting point (:mod:`.pretrain`), soaks (:mod:`.soak`).
* The run record: :class:`RunDir`, :class:`Summary` (:mod:`.record`), a finished launch in
  numbers (:mod:`.summarize`), measurements (:mod:`.measure`) and reports (:mod:`.report`,
  :mod:`.report_html`).

run may import every package below it (lab, strategies, checkpoint, reduce, comm, the coordinator,
the floor). Never imports cli (docs/ARCHITECTURE.md, "Layers"; tools/structure.py checks it).
"""

from isthmus.run.config import RunConfig, apply_overrides, from_flat
from isthmus.run.record import PeerResult, RunDir, Summary

__all__ = ["PeerResult", "RunConfig", "RunDir", "Summary", "apply_overrides", "from_flat"]
