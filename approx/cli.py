"""Kept so that ``python -m approx.cli ...`` and ``accelerate launch -m approx.cli ...`` (the documented
commands before the harness moved to :mod:`approx.harness`) keep working; ``python -m approx`` is the short form.
"""

import sys

from .harness.cli import main

if __name__ == "__main__":
    sys.exit(main())
