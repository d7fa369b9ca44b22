"""`python -m metatrain.cli ...` is `metatrain ...` (the local launcher starts processes this way)."""

import sys

try:
    from metatrain.cli import main
except KeyboardInterrupt:  # Ctrl-C while the program starts
    print("metatrain: stopped by SIGINT", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
