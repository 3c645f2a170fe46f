"""The layer order of docs/architecture.md, checked by import-linter (pyproject.toml ``[tool.importlinter]``):
each layer imports only those below it, and nothing below ``lightning/`` imports Lightning or torchmetrics.
import-linter reads every import statement, lazy ones inside functions included."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_pipe

ROOT = Path(__file__).resolve().parents[2]


def test_the_layer_contracts_of_pyproject_hold() -> None:
    if importlib.util.find_spec("importlinter") is None:  # a hard failure: a skip would let CI pass without the contract
        pytest.fail("import-linter is part of the test extra: pip install -e '.[test]'")
    assert Path(lightning_pipe.__file__).resolve().parent == ROOT / "lightning_pipe", "checks another copy of the package"
    # in a process of its own: import-linter changes the logging configuration of the process it runs in
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True, no_logo=True))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_contract_lists_every_package_of_the_layout() -> None:
    """A new top-level module or package must be placed in the layers (docs/architecture.md too)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["type"] == "layers")["layers"]
    placed = {name.strip().removeprefix("lightning_pipe.") for layer in layers for name in layer.split("|")}
    package = ROOT / "lightning_pipe"
    present = {p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")}
    present |= {p.parent.name for p in package.glob("*/__init__.py")}
    assert present == placed, f"not placed in [tool.importlinter]'s layers: {sorted(present - placed)}; gone: {sorted(placed - present)}"
