"""p4/testgen_vectors.py as a module: p4/ is no package (`p4` is p4runtime's protobuf package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PATH = Path(__file__).resolve().parent.parent.parent / "p4" / "testgen_vectors.py"


def load() -> ModuleType:
    """The module, loaded once per process under the name ``testgen_vectors``."""
    if "testgen_vectors" not in sys.modules:
        spec = importlib.util.spec_from_file_location("testgen_vectors", PATH)
        module = importlib.util.module_from_spec(spec)
        sys.modules["testgen_vectors"] = module  # before exec: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["testgen_vectors"]
