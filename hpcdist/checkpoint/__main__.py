"""``python -m hpcdist.checkpoint inspect|verify|export DIR`` (tools.py)."""
import sys

from .tools import main

sys.exit(main())
