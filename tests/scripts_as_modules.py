"""Import a script of examples/ or benchmarks/ in the test process (its main(argv) is what the script runs)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path, name: str | None = None) -> ModuleType:
    """The script at ``path`` as a module named ``name`` (its file name by default), registered in ``sys.modules``
    (dataclasses defined in it look their module up there)."""
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
