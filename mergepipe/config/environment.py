"""MERGEPIPE_HOME: where the default catalog, saved plans and the upload spool live."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("MERGEPIPE_HOME", "~/.mergepipe")).expanduser()
