"""``python -m poslsh_paper ...``: the same as the ``poslsh`` command."""
import sys

from poslsh_paper.cli import main

sys.exit(main())
