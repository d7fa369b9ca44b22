"""`python -m metatrain.cli ...` is `metatrain ...` (the local launcher starts processes this way)."""

import sys

from metatrain.cli import main

sys.exit(main())
