"""``python -m ortpa``: the ``ortpa`` console script, from a checkout or an install."""

import sys

from ortpa.cli import main

sys.exit(main())
