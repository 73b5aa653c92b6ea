"""``python -m fastckpt.cli``: the same as the ``fastckpt`` command."""

import sys

from fastckpt.cli import main

sys.exit(main())
