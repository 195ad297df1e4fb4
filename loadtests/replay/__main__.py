"""``python -m loadtests.replay``: the offline replay's command line (``cli``)."""

from loadtests.replay.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
