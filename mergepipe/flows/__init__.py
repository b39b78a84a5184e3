"""Prefect flows: index_family, merge, replay. Thin: they sequence tasks and add up ledgers."""
