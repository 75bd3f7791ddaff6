"""`python -m candlewick` runs the command line."""

import sys

from .cli import main

# Tools that import every module (mypy's stubtest, pydoc) must not run the command line.
if __name__ == "__main__":
    sys.exit(main())
