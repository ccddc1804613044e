"""`python -m rlrunner.checkpoint list|verify ...`: the checkpoint inspector (rlrunner.tools.inspect)."""

import sys

from rlrunner.tools.inspect import main

if __name__ == "__main__":
    sys.exit(main())
