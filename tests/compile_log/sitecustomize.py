"""Imported at start-up by the Python processes the tests start while this folder is on PYTHONPATH (conftest puts
it there under $METATRAIN_COMPILE_LOG): their compile events are logged too."""

import compile_events

compile_events.install()
