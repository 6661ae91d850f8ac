"""``python -m mshard run ...``: the same as the ``mshard`` console command (see :mod:`mshard._src.edges.launch`)."""

import sys

from mshard._src.edges.launch import main

if __name__ == "__main__":
    sys.exit(main())
