"""The type checker runs over every project module, as the wheel lays them out.

The folders map to `kubetrt.*` packages through pyproject's package-dir, which mypy cannot read,
so the check runs on a tree of links shaped like the installed package. Settings are
pyproject's [tool.mypy]; errors are reported with the repository's own paths.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from test_architecture import ROOT, package_dirs


def installed_layout(dest: Path) -> dict[str, Path]:
    """Links under `dest` shaped like the installed package; returns link prefix -> real folder."""
    prefixes: dict[str, Path] = {}
    for name, folder in sorted(package_dirs().items()):
        where = dest.joinpath(*name.split("."))
        if name.count(".") == 0:
            where.mkdir(parents=True)
            for child in folder.iterdir():
                if child.suffix == ".py":
                    (where / child.name).symlink_to(child)
        else:
            where.symlink_to(folder, target_is_directory=True)
        prefixes[where.relative_to(dest).as_posix() + "/"] = folder
    return prefixes


def test_mypy_finds_no_type_errors(tmp_path: Path) -> None:
    prefixes = installed_layout(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "-p", "kubetrt", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(ROOT / ".cache" / "mypy"), "--no-error-summary", "--hide-error-context"],
        cwd=tmp_path, capture_output=True, text=True,
    )
    report = proc.stdout
    for link, folder in sorted(prefixes.items(), key=lambda kv: -len(kv[0])):
        report = report.replace(link, folder.relative_to(ROOT).as_posix() + "/" if folder != ROOT else "")
    assert proc.returncode == 0, f"mypy found type errors:\n{report}{proc.stderr}"
