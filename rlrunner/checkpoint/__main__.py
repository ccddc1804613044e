"""`python -m rlrunner.checkpoint list|verify ...`: the checkpoint inspector (inspect.py)."""

import sys

from rlrunner.checkpoint.inspect import main

if __name__ == "__main__":
    sys.exit(main())
