"""``python -m ortpa``: the ``ortpa`` console script, from a checkout or an install."""

from ortpa.cli import entry

entry()
