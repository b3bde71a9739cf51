"""The Space as it deploys: a fresh virtual environment with only what a Hugging Face Space installs (requirements.txt,
plus gradio at the README front matter's sdk_version), then the front matter's app_file run from the repository in
Space mode, answering through gradio_client on the pair it serves.

torch is installed first, as .ci/run installs it for the main venv (torch==2.13.0, the CPU build; a Space takes
whatever `torch` requirements.txt allows). llama-cpp-python comes from pip's wheel cache when an earlier install built
it (./dev.sh setup does), else it is built from source here as a Space builds it (minutes). The models come from the
suite's model cache."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import venv
from pathlib import Path

import httpx
import pytest
import yaml

pytestmark = pytest.mark.real_models
ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a Python function that returns the square of a number."
N = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def front_matter() -> dict:
    return yaml.safe_load((ROOT / "README.md").read_text().split("---\n")[1])


def pip(python: Path, *args: str, env: dict) -> None:
    # --no-compile: byte-compiling every installed module halves the install's CPU time and changes nothing that runs
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, f"pip install {' '.join(args)} failed:\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def space(real_paths, tmp_path_factory):
    """The Space: a fresh venv with only its installs, `python <app_file>` in Space mode on a local port."""
    from conftest import USER_CACHE

    fm = front_matter()
    home = tmp_path_factory.mktemp("space")
    venv.create(home / "venv", with_pip=True)
    python = home / "venv" / "bin" / "python"
    # what the Space sees: nothing of this checkout's environment (no PYTHONPATH, no venv of ours)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    started = time.perf_counter()
    pip(python, "torch==2.13.0", env=env)
    pip(python, "-r", str(ROOT / "requirements.txt"), f"gradio=={fm['sdk_version']}", env=env)
    installed = time.perf_counter() - started
    port = free_port()
    env |= {
        "USD_CHAT_SPACE": "1",
        "GRADIO_SERVER_NAME": "127.0.0.1",  # a Space binds 0.0.0.0; a test binds this machine only
        "GRADIO_SERVER_PORT": str(port),
        "USD_CHAT_CACHE": str(USER_CACHE),
    }
    log_path = home / "space.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(python), fm["app_file"]], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.time() + 600
        while True:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.time() < deadline, f"the Space did not serve its UI:\n{log_path.read_text()[-4000:]}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=5).is_success:
                    break
            time.sleep(1)
        print(f"space: installed in {installed:.0f} s, served after {time.perf_counter() - started:.0f} s")
        yield url, log_path
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_the_space_as_deployed_answers_a_chat_on_its_pair(space, catalog):
    from gradio_client import Client

    url, log_path = space
    ui = Client(url, verbose=False)
    job = ui.submit(prompt=PROMPT, max_new_tokens=N, api_name="/generate")
    updates = list(job)
    text, pieces, stats = job.result()
    assert text and len(updates) >= 2 and stats["tokens"] == N and stats["stop_reason"] == "max_tokens"
    assert "".join(p["text"] for p in pieces if p["kind"] != "rejected") == text
    plain, speculative, summary = ui.predict(prompt=PROMPT, algorithm="slem", max_new_tokens=N, api_name="/compare")
    assert summary["identical"] and plain == speculative  # lossless on the Space's own pair
    log = log_path.read_text()
    for name in (catalog.default.target, catalog.default.drafter):
        assert f"loading {name}: gguf on cpu" in log, "requirements.txt brings llama.cpp: the pair runs on it"


def test_the_space_serves_only_its_models(space):
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    ui = Client(space[0], verbose=False)
    with pytest.raises(AppError, match="this Space serves only its catalog models"):
        ui.predict(prompt=PROMPT, target="/etc", max_new_tokens=2, api_name="/generate")
