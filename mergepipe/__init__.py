"""mergepipe: budget-aware weight-space merging of checkpoint families."""

__version__ = "0.1.0"
