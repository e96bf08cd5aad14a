"""``python -m approx ...`` (and ``accelerate launch -m approx ...``): the ``approx`` command line."""

import sys

from .harness.cli import main

sys.exit(main())
