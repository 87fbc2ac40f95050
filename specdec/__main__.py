"""``python -m specdec ...`` (and ``torchrun ... -m specdec bench CONFIG``): the ``specdec`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
