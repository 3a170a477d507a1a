"""Bundled example models and datasets (no download needed)."""
