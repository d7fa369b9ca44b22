"""Grain next-token data pipelines (being built)."""
