import sys

from aqsgd.cli import main

sys.exit(main())
