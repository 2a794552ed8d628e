"""`python -m services.cli`: what `mirror-sd` runs (child processes of `mirror-sd up` start this way)."""

import sys

from services.cli import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
