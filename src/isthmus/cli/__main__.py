"""``python -m isthmus.cli``: the same as the ``isthmus`` command."""

import sys

from isthmus.cli import main

sys.exit(main())
