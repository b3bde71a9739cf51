"""`python -m usd.bench`: the same as `usd bench`, restarted in huge pages as `usd` is (usd/hugepages.py)."""

import sys

from ..hugepages import restart_with_huge_pages

restart_with_huge_pages()

from .run import main  # noqa: E402 (after the restart: nothing heavy is imported twice)

sys.exit(main())
