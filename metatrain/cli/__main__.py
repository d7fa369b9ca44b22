"""`python -m metatrain.cli ...` is `metatrain ...` (the local launcher starts processes this way), kept to the CPU
where libtpu is installed on a machine without TPU chips as the program is, without its huge-page relaunch
(`metatrain.entry`)."""

import sys

try:
    from metatrain.cli import freeze_imported, main
    from metatrain.entry import keep_to_cpu
except KeyboardInterrupt:  # Ctrl-C while the program starts
    print("metatrain: stopped by SIGINT", file=sys.stderr)
    sys.exit(130)

keep_to_cpu()
freeze_imported()
sys.exit(main())
