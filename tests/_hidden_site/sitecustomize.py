"""Hides the extras ``$PACS_HIDE_EXTRAS`` names in a Python child of the test suite (tests/_extras.py puts this
directory first on the children's ``PYTHONPATH``)."""

import importlib.util
import os
import sys
from pathlib import Path

if os.environ.get("PACS_HIDE_EXTRAS") and "_extras" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("_extras", Path(__file__).resolve().parents[1] / "_extras.py")
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["_extras"] = _mod
    _spec.loader.exec_module(_mod)
    _mod.install_from_env()
