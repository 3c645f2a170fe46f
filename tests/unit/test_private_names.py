"""No module but ``lightning/_compat.py`` imports or reads a private Lightning name (issue 31).

A private name of Lightning can change in any minor release without a deprecation; kept in one module, each
has a test of its own (tests/unit/test_compat.py) that names what changed. This test reads the package's
source (``ast``, nothing is imported) and fails on, with ``file:line``:

* an import from ``lightning``, ``lightning_fabric`` or ``pytorch_lightning`` of an underscore name, or
  through an underscore module (``lightning.pytorch.strategies.launchers._x``);
* an attribute read or written as ``x._name`` (not a dunder) where ``_name`` is defined nowhere in the
  package outside ``_compat.py`` (a method, class, function, argument or assigned attribute of its own),
  unless it is one of the torch and standard-library names allowed below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_pipe

PACKAGE = Path(lightning_pipe.__file__).parent
COMPAT = PACKAGE / "lightning" / "_compat.py"
LIGHTNING_ROOTS = ("lightning", "lightning_fabric", "pytorch_lightning")

#: Private names of torch and the standard library the package reads on purpose. Each is either the only
#: way to do the job or saves a copy the size of the model; none belongs to Lightning.
ALLOWED = {
    "_exit": "os._exit: end a process without running atexit handlers (a rank hung in C++, a fork)",
    "_modules": "nn.Module._modules: replace a child of a Sequential/ModuleList in place, keeping state_dict keys",
    "_parameters": "nn.Module._parameters: swap a meta parameter for a materialised one in place; bind a weight "
                   "version for a forward without nn.Module.__setattr__'s checks (policies.base.Binding)",
    "_foreach_norm": "torch._foreach_norm: a global norm without a temporary the size of the gradients",
    "_foreach_copy_": "torch._foreach_copy_: one fused copy of a stage's weights into a stashed version (or into the "
                      "parameters, where storages cannot be exchanged)",
    "_foreach_sub_": "torch._foreach_sub_: pipemare's corrected weights in one launch where storages cannot be exchanged",
    **{name: f"torch.{name}: xpipe's weight prediction and pipemare's velocity fused (as torch's foreach optimizers), "
             "a few launches per stage instead of several per parameter"
       for name in ("_foreach_div_", "_foreach_add_", "_foreach_mul", "_foreach_mul_", "_foreach_sqrt_", "_foreach_div")},
    "_foreach_sub": "torch._foreach_sub: avgpipe's elastic averaging fused, four launches per stage instead of four per "
                    "parameter",
    "_foreach_lerp_": "torch._foreach_lerp_: pipedream_2bw's look-ahead snapshot fused, one launch instead of one per "
                      "parameter",
    "_base": "Tensor._base: the cast a saved view was taken of, so pipemare's and xpipe's backwards under autocast read "
             "the weights the storage holds then, not the forward's cast (policies.live._CastOfParameter)",
    "_swap_data_ptr_": "UntypedStorage._swap_data_ptr_: exchange two weight versions (and their views) without a copy",
    "_set_pg_timeout": "distributed_c10d._set_pg_timeout: a group's timeout after start-up (no public setter)",
    "_get_default_store": "distributed_c10d._get_default_store: the store's timeout, and the watchdog's inbox",
    "_per_optimizer_states": "torch.amp.GradScaler: the found-inf flags unscale_ recorded, agreed across the pipeline",
    "_check_inf_per_device": "torch.amp.GradScaler: where a fused optimizer's step looks for infs (agreed the same way)",
    "_scale": "torch.amp.GradScaler._scale: the device of a rank with no gradient's zero flag",
    "_execution_engine": "Variable._execution_engine.run_backward: a zero-bubble W runs one autograd call per weight "
                         "group, and torch.autograd.backward's per-call checks were half of each call's host time",
    "_get_fsdp_state": "FSDPModule._get_fsdp_state: a unit's forward without FSDP2's hooks, in FSDP2's own recompute "
                       "state (ShardedLayers.early_forward; tests/distributed/test_fsdp.py fails if the path is gone)",
}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != COMPAT)


def _own_names(paths: list[Path]) -> set[str]:
    """Every name the package defines itself: functions, classes, arguments, assigned names and attributes."""
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _violations(path: Path, own: set[str]) -> list[str]:
    found = []
    where = path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent) else path.name
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] in LIGHTNING_ROOTS:
                names = [a.name for a in node.names if _private(a.name)]
                if any(_private(p) for p in parts) or names:
                    found.append(f"{where}:{node.lineno}: from {node.module} import {', '.join(names) or '...'}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in LIGHTNING_ROOTS and any(_private(p) for p in parts):
                    found.append(f"{where}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own and node.attr not in ALLOWED:
            found.append(f"{where}:{node.lineno}: .{node.attr}")
    return sorted(found, key=lambda v: int(v.split(':')[1]))


def test_no_private_lightning_name_outside_compat() -> None:
    paths = _modules()
    own = _own_names(paths)
    found = [v for path in paths for v in _violations(path, own)]
    assert not found, ("private names of Lightning (or unlisted torch ones) outside lightning_pipe/lightning/_compat.py; "
                       "move each into a function there, with a test in tests/unit/test_compat.py:\n  " + "\n  ".join(found))


def test_the_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    """The scanner itself: each kind of violation is found, the package's own private names are not."""
    source = tmp_path / "sample.py"
    source.write_text(
        "from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher\n"
        "from lightning.fabric.utilities import _private_module\n"
        "from lightning.pytorch._graveyard import x\n"
        "import lightning.pytorch._graveyard\n"
        "def f(trainer, self):\n"
        "    trainer._checkpoint_connector\n"
        "    self._own = 1\n"
        "    return self._own, trainer.__class__, trainer.public\n"
    )
    found = _violations(source, _own_names([source]) | set(ALLOWED))
    # paths relative to the package's parent: the sample lives elsewhere, so compare the tails
    tails = [v.split(": ", 1)[1] for v in found]
    assert tails == [
        "from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher",
        "from lightning.fabric.utilities import _private_module",
        "from lightning.pytorch._graveyard import ...",
        "import lightning.pytorch._graveyard",
        "._checkpoint_connector",
    ], found
