"""The bench scripts' CPU tests: run with ``python -m pytest bench/tests`` (the whole suite includes them)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# As in tests/conftest.py: tiny models gain nothing from intra-op threads. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

#: The repository root, so that ``import bench.<script>`` works from any working folder.
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
