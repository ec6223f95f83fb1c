"""`python -m losscheck.cli`: the `losscheck` command."""

import sys

from losscheck.cli import main

if __name__ == "__main__":
    sys.exit(main())
