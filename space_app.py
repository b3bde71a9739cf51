"""The Hugging Face Space entry point (README front matter `app_file`): the app in Space mode, on the Space's port."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("USD_CHAT_SPACE", "1")
os.environ.setdefault("GRADIO_SERVER_NAME", "0.0.0.0")  # a Space routes to the container's port 7860

from app.__main__ import run

if __name__ == "__main__":
    sys.exit(run())
