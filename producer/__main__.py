"""``python -m producer`` is the ``inferline`` command."""
import sys

from producer.cli import main

sys.exit(main())
