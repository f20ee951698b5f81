"""`python -m lab.study`: see `lab.study.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
