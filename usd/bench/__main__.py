"""`python -m usd.bench`: the same as `usd bench`."""

import sys

from .run import main

sys.exit(main())
