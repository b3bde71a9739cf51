"""Huge pages for the models' weights: the programs (`usd`, `usd-chat`, `python -m app`, the Space, `python -m
usd.bench`) restart themselves once, at their start, with glibc asked to put every large allocation in transparent
huge pages.

Why: decoding reads all of the target's weights every step. llama.cpp repacks a GGUF's weights into memory it
allocates with malloc, and where the kernel gives transparent huge pages only to memory that asks for them (the
`madvise` mode, common on distributions and cloud hosts), nothing asks: the weights sit in 4 KiB pages, and each step
touches hundreds of thousands of them, far more than the TLB holds. glibc (2.35 and later) asks for them itself
under the tunable `glibc.malloc.hugetlb=1`, but reads its tunables only when a process starts, and nothing can ask
later for memory already written (MADV_COLLAPSE, the one way, is missing from some kernels). Hence the restart,
before anything is loaded. docs/benchmarks.md ("Huge pages for the weights") has the measurement, side by side.

Not done where it cannot help (another OS or C library, an older glibc, a kernel that gives huge pages to every
mapping already or to none), nor where the process was started with any `glibc.malloc.hugetlb` choice of its own:
`GLIBC_TUNABLES=glibc.malloc.hugetlb=0` keeps 4 KiB pages. A library user's process is never restarted.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.hugetlb"
ASK_FOR_HUGE_PAGES = f"{TUNABLE}=1"
FIRST_GLIBC_WITH_IT = (2, 35)
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_MODE_FILE) -> str | None:
    """The kernel's transparent-huge-page mode for anonymous memory (`always`, `madvise`, `never`), or None where
    there is no such file (not Linux, or a kernel without them)."""
    try:
        with open(path) as f:
            words = f.read().split()
    except OSError:
        return None
    chosen = [w.strip("[]") for w in words if w.startswith("[")]
    return chosen[0] if chosen else None


def glibc_version() -> tuple[int, ...] | None:
    """This process's glibc version, or None under another C library."""
    try:
        name = os.confstr("CS_GNU_LIBC_VERSION")  # "glibc 2.36"
    except (ValueError, OSError, AttributeError):
        return None
    if not name or not name.startswith("glibc "):
        return None
    try:
        return tuple(int(part) for part in name.split()[1].split(".")[:2])
    except ValueError:
        return None


def glibc_can_ask(mode: str | None, glibc: tuple[int, ...] | None) -> bool:
    """Whether the tunable decides the pages here: the kernel gives huge pages on request, and glibc can ask."""
    return mode == "madvise" and glibc is not None and glibc >= FIRST_GLIBC_WITH_IT


def environment_with_huge_pages(
    environ: Mapping[str, str], mode: str | None, glibc: tuple[int, ...] | None
) -> dict[str, str] | None:
    """The environment to restart in, or None where a restart would not help or the tunable was chosen already."""
    if not glibc_can_ask(mode, glibc):
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if TUNABLE in tunables:
        return None
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{ASK_FOR_HUGE_PAGES}" if tunables else ASK_FOR_HUGE_PAGES}


def huge_pages_in_use(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process's large allocations land in huge pages, which the speed of a step depends on."""
    mode = thp_mode()
    if mode != "madvise":
        return mode == "always"
    asked = {f"{TUNABLE}=1", f"{TUNABLE}=2"} & set(environ.get("GLIBC_TUNABLES", "").split(":"))
    return bool(asked) and glibc_can_ask(mode, glibc_version())


def restart_with_huge_pages() -> None:
    """For the programs' entry points only, before they import or load anything: replace this process with the same
    command under the tunable, where that helps (the module docstring). Returns only where it does not."""
    env = environment_with_huge_pages(os.environ, thp_mode(), glibc_version())
    if env is None or not sys.executable:  # (an embedded interpreter has no executable to restart)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:
        return  # not restarted: the program runs as it is, in 4 KiB pages
