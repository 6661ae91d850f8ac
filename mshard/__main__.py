"""``python -m mshard run ...``: the same as the ``mshard`` console command (see :mod:`mshard.launch`)."""

import sys

from .launch import main

if __name__ == "__main__":
    sys.exit(main())
