"""`python -m usd` and the `usd` command: restarted in huge pages where that helps (usd/hugepages.py), then the CLI."""

import sys

from .hugepages import restart_with_huge_pages


def run() -> int:
    restart_with_huge_pages()
    from .cli import main  # after the restart: nothing heavy is imported twice

    return main()


if __name__ == "__main__":
    sys.exit(run())
