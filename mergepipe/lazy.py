"""Heavy libraries bound at import and loaded on first use, so that commands which never compute
on tensors (plan, verify, catalog) do not pay for loading them."""

from __future__ import annotations

import lazy_loader

# Operator declarations, dtype tables and type hints name torch at import; only arithmetic needs it.
torch = lazy_loader.load("torch")
