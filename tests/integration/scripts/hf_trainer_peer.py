"""examples/hf_trainer.py with a fault on one peer and a pace, for `isthmus run`.

``--fault SPEC`` fires on the first process of ``--fault-peer`` only (its restart, ``peer1.1``,
runs clean); ``--delay S`` sleeps after every optimizer step, so that a restarted peer has the
time to start and join before the run ends. Every other argument is the example's.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

import isthmus

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "hf_trainer.py"


class Pace(TrainerCallback):  # type: ignore[misc]
    def __init__(self, delay: float) -> None:
        self.delay = delay

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        time.sleep(self.delay)
        return control


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fault", default=None)
    ap.add_argument("--fault-peer", default="peer1")
    ap.add_argument("--delay", type=float, default=0.0)
    mine, rest = ap.parse_known_args()
    spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    fire = mine.fault and os.environ.get("ISTHMUS_NAME") == mine.fault_peer
    faults = isthmus.FaultInjector([isthmus.Fault.parse(mine.fault)] if fire else [])
    example.main(rest, faults=faults, callbacks=[Pace(mine.delay)])


if __name__ == "__main__":
    main()
