"""``python -m loadtests.bench``: the live benchmark's command line (``live``)."""

import sys

from loadtests.bench.live import main

if __name__ == "__main__":
    sys.exit(main())
