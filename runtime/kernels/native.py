"""Finding the native libraries that optional wheels (mkl, onednn) install under <prefix>/lib."""
from __future__ import annotations

import ctypes
import site
import sys
from pathlib import Path


def wheel_library_paths(names: tuple[str, ...]) -> list[Path]:
    """Where pip puts a wheel's data libraries: the venv's <prefix>/lib, the base install's, --user's."""
    dirs = [Path(sys.prefix) / "lib", Path(sys.base_prefix) / "lib", Path(site.getuserbase()) / "lib"]
    return [d / name for d in dirs for name in names]


def load_first(names: tuple[str, ...]) -> ctypes.CDLL | None:
    """The first of `names` that loads, RTLD_LOCAL so its symbols never shadow NumPy's own BLAS."""
    for path in wheel_library_paths(names):
        if not path.is_file():
            continue
        try:
            return ctypes.CDLL(str(path))
        except OSError:
            continue
    return None
