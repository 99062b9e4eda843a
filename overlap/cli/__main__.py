"""``python -m overlap.cli``: the ``overlap`` command."""

import sys

from . import main

sys.exit(main())
