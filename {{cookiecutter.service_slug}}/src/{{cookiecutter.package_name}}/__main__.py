"""`python -m <package>`: the command line (see `entrypoints.cli`)."""

from .entrypoints.cli import main

if __name__ == "__main__":
    main()
