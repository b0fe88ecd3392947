"""``python -m poslsh ...``: the same as the ``poslsh`` command."""
import sys

from .cli import main

sys.exit(main())
