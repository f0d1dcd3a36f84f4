"""``python -m hpcdist.checkpoint inspect|verify|export DIR`` (cli.py)."""
import os
import sys

from .cli import main

try:
    code = main()
    sys.stdout.flush()
except BrokenPipeError:             # ``inspect ... | head``: the reader has what it wanted
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    code = 0
sys.exit(code)
