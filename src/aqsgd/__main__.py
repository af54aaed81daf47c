"""``python -m aqsgd ...``: the ``aqsgd`` command (the form to use under ``torchrun -m``)."""

import sys

from aqsgd.cli import main

sys.exit(main())
