"""`python -m metatrain.cli ...` is `metatrain ...` (the local launcher starts processes this way)."""

import sys

try:
    from metatrain.cli import freeze_imported, main
except KeyboardInterrupt:  # Ctrl-C while the program starts
    print("metatrain: stopped by SIGINT", file=sys.stderr)
    sys.exit(130)

freeze_imported()
sys.exit(main())
