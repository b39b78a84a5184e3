"""mergepipe: budget-aware weight-space merging of checkpoint families."""

import lazy_loader

__version__ = "0.1.0"

# torch, bound here and loaded by its first use (`from mergepipe import torch` in the stages):
# commands that never compute on tensors (plan, verify, catalog) do not pay for loading it.
# Operator declarations, dtype tables and type hints name torch at import; only arithmetic
# needs it. A plain `import torch` would load it at once (the import system reads the module's
# __spec__, which makes a lazy module load).
torch = lazy_loader.load("torch")
