"""``python -m exgrpo_trl.cli``: the `exgrpo` command."""

import sys

from . import main

sys.exit(main())
