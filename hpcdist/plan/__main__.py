"""``python -m hpcdist.plan``."""
import sys

from .cli import main

sys.exit(main())
