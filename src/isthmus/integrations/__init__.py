"""isthmus.integrations: isthmus under the training frameworks people already use.

* :mod:`isthmus.integrations.hf`: a ``transformers.Trainer`` trained by any isthmus strategy
  (an optimizer wrapper whose ``step`` is the strategy's, a callback that keeps the Trainer's
  step count and learning-rate schedule on the run's, finishes the strategy and writes the
  model with ``save_pretrained``), and a reader that feeds a ``datasets.Dataset`` through the
  elastic exactly-once sampler. It needs the ``hf`` extra (``pip install 'isthmus[hf]'``); this
  package's ``__init__`` imports none of it, so ``import isthmus`` never needs transformers.

integrations sits beside the lab: it may import strategies, checkpoint, reduce, comm, the
coordinator and the floor (data, spec). Never imports run or cli (docs/ARCHITECTURE.md,
"Layers"; tools/structure.py checks it).
"""
