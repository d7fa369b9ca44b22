"""Launchers: `python -m launch.local` (N processes on this machine) and `python -m launch.tpu` (TPU VMs)."""
