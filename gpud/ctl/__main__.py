"""``python -m gpud.ctl``: gpuctl."""

import sys

from gpud.ctl.main import main

sys.exit(main())
