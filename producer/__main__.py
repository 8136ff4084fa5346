"""``python -m inferline.producer`` is the ``inferline`` command."""

import sys

from inferline.producer.cli import main

sys.exit(main())
