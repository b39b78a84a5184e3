"""Execution: merging one layer group from the base and the planned expert rows into the staged output."""
