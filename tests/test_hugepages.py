"""The programs (`usd`, `usd-chat`, `python -m app`, the Space) restart themselves once, at their start, so that glibc
puts large allocations, llama.cpp's repacked weights among them, in transparent huge pages where the kernel gives
them only on request (usd/hugepages.py). The rule is checked case by case; the restart is checked for real in a child
process, down to the loaded weights, where this machine's kernel and glibc can show it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from usd import hugepages
from usd.hugepages import ASK_FOR_HUGE_PAGES, environment_with_huge_pages

ROOT = Path(__file__).resolve().parents[1]
GLIBC = (2, 36)


@pytest.mark.parametrize(
    ("environ", "mode", "glibc", "tunables"),
    [
        ({}, "madvise", GLIBC, ASK_FOR_HUGE_PAGES),
        (
            {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
            "madvise",
            GLIBC,
            f"glibc.malloc.arena_max=2:{ASK_FOR_HUGE_PAGES}",
        ),
        ({}, "madvise", (2, 35), ASK_FOR_HUGE_PAGES),
        ({}, "madvise", (2, 34), None),  # the tunable came with 2.35
        ({}, "madvise", None, None),  # another C library
        ({}, "always", GLIBC, None),  # huge pages for every mapping already
        ({}, "never", GLIBC, None),  # none to be had
        ({}, None, GLIBC, None),  # not Linux, or no transparent huge pages
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", GLIBC, None),  # the user's choice: 4 KiB pages
        ({"GLIBC_TUNABLES": ASK_FOR_HUGE_PAGES}, "madvise", GLIBC, None),  # restarted already: never twice
    ],
)
def test_a_restart_asks_for_huge_pages_only_where_the_kernel_gives_them_on_request(environ, mode, glibc, tunables):
    env = environment_with_huge_pages({"PATH": "/bin", **environ}, mode, glibc)
    if tunables is None:
        assert env is None
    else:
        assert env == {"PATH": "/bin", "GLIBC_TUNABLES": tunables}


@pytest.mark.parametrize(
    ("mode", "tunables", "in_use"),
    [
        ("madvise", ASK_FOR_HUGE_PAGES, True),
        ("madvise", f"glibc.malloc.arena_max=2:{ASK_FOR_HUGE_PAGES}", True),
        ("madvise", "glibc.malloc.hugetlb=0", False),
        ("madvise", "", False),
        ("always", "", True),
        ("never", ASK_FOR_HUGE_PAGES, False),
        (None, ASK_FOR_HUGE_PAGES, False),
    ],
)
def test_whether_huge_pages_are_in_use_follows_the_kernel_and_the_tunable(monkeypatch, mode, tunables, in_use):
    monkeypatch.setattr(hugepages, "thp_mode", lambda: mode)
    monkeypatch.setattr(hugepages, "glibc_version", lambda: GLIBC)
    assert hugepages.huge_pages_in_use({"GLIBC_TUNABLES": tunables}) is in_use


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]", "never"),
    ],
)
def test_the_kernels_mode_is_the_bracketed_word(tmp_path, text, mode):
    f = tmp_path / "enabled"
    f.write_text(text)
    assert hugepages.thp_mode(str(f)) == mode
    assert hugepages.thp_mode(str(tmp_path / "missing")) is None


class Restarted(Exception):
    pass


@pytest.mark.parametrize("program", ["usd.__main__", "app.__main__"])
def test_each_program_restarts_itself_before_it_runs(monkeypatch, program):
    import importlib

    module = importlib.import_module(program)
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(hugepages, "glibc_version", lambda: GLIBC)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)

    def execve(path, argv, env):
        raise Restarted(path, argv, env)

    monkeypatch.setattr(os, "execve", execve)
    with pytest.raises(Restarted) as restarted:
        module.run()
    path, argv, env = restarted.value.args
    assert path == sys.executable and argv == [sys.executable, *sys.orig_argv[1:]]
    assert env["GLIBC_TUNABLES"] == ASK_FOR_HUGE_PAGES


def test_the_installed_commands_and_the_space_start_through_the_restart():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"usd": "usd.__main__:run", "usd-chat": "app.__main__:run"}
    space = (ROOT / "space_app.py").read_text()  # not imported: it switches this process to Space mode
    assert "from app.__main__ import run\n" in space and "sys.exit(run())" in space


def huge_pages_here() -> bool:
    glibc = hugepages.glibc_version()
    return hugepages.thp_mode() == "madvise" and glibc is not None and glibc >= hugepages.FIRST_GLIBC_WITH_IT


needs_madvise_mode = pytest.mark.skipif(
    not huge_pages_here(), reason="the restart only acts where THP is madvise-only and glibc is 2.35 or later"
)

MEMORY = """
def memory():
    rows = (line.split() for line in open("/proc/self/smaps_rollup"))
    return {row[0].rstrip(":"): int(row[1]) for row in rows if row[0] in ("Anonymous:", "AnonHugePages:")}
"""


def child(code: str, **env: str) -> str:
    """Run `code` in a fresh interpreter that restarts itself as the programs do; what it prints."""
    program = f"from usd.hugepages import restart_with_huge_pages\nrestart_with_huge_pages()\n{MEMORY}\n{code}"
    environ = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | env
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@needs_madvise_mode
def test_a_restarted_process_gets_huge_pages_for_a_large_allocation():
    code = textwrap.dedent("""
        import os
        before = memory()["AnonHugePages"]
        block = bytearray(64 << 20)
        block[:: 4096] = b"x" * len(block[:: 4096])  # touch every page
        print(os.environ.get("GLIBC_TUNABLES"), memory()["AnonHugePages"] - before)
    """)
    tunables, huge_kib = child(code).split()
    assert tunables == ASK_FOR_HUGE_PAGES
    assert int(huge_kib) >= 32 << 10, "most of a 64 MiB block in huge pages"
    tunables, huge_kib = child(code, GLIBC_TUNABLES="glibc.malloc.hugetlb=0").split()
    assert tunables == "glibc.malloc.hugetlb=0" and int(huge_kib) == 0, "the user's own choice is kept"


@needs_madvise_mode
@pytest.mark.real_models
def test_the_llamacpp_runners_weights_load_into_huge_pages(real_paths):
    from usd.runners import llamacpp

    if not llamacpp.available():
        pytest.skip("llama-cpp-python is not installed")
    code = textwrap.dedent("""
        from usd.catalog import load_catalog
        from usd.loading import load_model
        before = memory()
        model = load_model(load_catalog().get("smollm2-135m-instruct"), device="cpu", precision="gguf", log=print)
        after = memory()
        print(after["Anonymous"] - before["Anonymous"], after["AnonHugePages"] - before["AnonHugePages"])
    """)
    import conftest

    from usd.store import CACHE_ENV

    cache = {CACHE_ENV: str(conftest.USER_CACHE)}
    anonymous_kib, huge_kib = map(int, child(code, **cache).split())
    assert huge_kib >= anonymous_kib // 2, f"{huge_kib} KiB of the load's {anonymous_kib} KiB in huge pages"
    anonymous_kib, huge_kib = map(int, child(code, **cache, GLIBC_TUNABLES="glibc.malloc.hugetlb=0").split())
    assert huge_kib == 0


def test_a_restart_that_fails_leaves_the_program_running(monkeypatch):
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(hugepages, "glibc_version", lambda: GLIBC)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)

    def execve(path, argv, env):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(os, "execve", execve)
    hugepages.restart_with_huge_pages()  # returns: the program goes on in 4 KiB pages
