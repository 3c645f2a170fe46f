"""The layering docs/architecture.md promises: the engine, schedules, planning and simulation run
without Lightning, and the registry is the one place schedule names are written."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
from importlib.util import find_spec

import lightning_pipe
from lightning_pipe import registry

PACKAGE = pathlib.Path(lightning_pipe.__file__).parent
WITHOUT_LIGHTNING = ("engine", "schedules", "planning", "sim", "partition", "registry", "errors")


def test_lower_layers_import_with_lightning_unimportable():
    blocked = ("lightning", "pytorch_lightning", "torchmetrics", "lightning_utilities")
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None  # an import of it now fails\n"
        + "".join(f"import lightning_pipe.{name}\n" for name in WITHOUT_LIGHTNING)
        + "import lightning_pipe\n"
        "assert not hasattr(lightning_pipe, 'PipeStrategy')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_no_lower_layer_module_imports_lightning():
    """A static check too, so a lazy import inside a function is caught as well."""
    pattern = re.compile(r"^\s*(from|import)\s+(lightning|pytorch_lightning|torchmetrics)\b", re.MULTILINE)
    offenders = [
        str(path.relative_to(PACKAGE))
        for name in WITHOUT_LIGHTNING
        for path in (sorted((PACKAGE / name).rglob("*.py")) if (PACKAGE / name).is_dir() else [PACKAGE / f"{name}.py"])
        if pattern.search(path.read_text())
    ]
    assert offenders == []


def _code_strings(tree: ast.AST) -> list[ast.Constant]:
    """String constants of code: not docstrings, not parts of f-strings (messages), not dict keys."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            skipped.add(id(body[0].value))  # a docstring
        if isinstance(node, ast.JoinedStr):
            skipped.update(id(v) for v in ast.walk(node))
        if isinstance(node, ast.Dict):
            skipped.update(id(k) for k in node.keys if k is not None)
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skipped]


def test_schedule_names_are_written_only_in_the_registry():
    """Outside registry.py, code refers to schedules through the registry (messages and docs aside).

    Allowed: lightning/options.py, whose option groups are named like the schedules they configure,
    schedules/avgpipe.py, the averaging generator labelling its own action lists, and quality.py, a
    table of benchmark measurements keyed by the schedules the benchmark ran."""
    allowed = {"registry.py", "lightning/options.py", "schedules/avgpipe.py", "schedules/__init__.py", "quality.py"}
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        if where in allowed:
            continue
        for node in _code_strings(ast.parse(path.read_text())):
            if node.value in registry.NAMES:
                offenders.append(f"{where}:{node.lineno}: {node.value!r}")
    assert offenders == [], "\n".join(offenders)


def test_a_new_schedule_is_one_generator_and_one_row(monkeypatch):
    """docs/architecture.md's example: a generator plus a registry row, and the validator, the
    planner, the simulator and the strategy's option checks all take it."""
    from lightning_pipe.planning.costs import Machine, in_flight
    from lightning_pipe.planning.planner import explore
    from lightning_pipe.planning.profile import LayerProfile, Profile
    from lightning_pipe.schedules.ir import STEP, B, F
    from lightning_pipe.sim import Costs, simulate

    def eager_1f1b(stage, stages, micro_batches):
        warmup = min(stages - stage, micro_batches)
        yield from (F(j) for j in range(warmup))
        for j in range(warmup, micro_batches):
            yield F(j)
            yield B(j - warmup)
        yield from (B(j) for j in range(micro_batches - warmup, micro_batches))
        yield STEP

    row = registry.ScheduleSpec("eager_1f1b", "synchronous", "1F1B with one more forward in flight",
                                generator=lambda d, p, m, v: eager_1f1b(d, p, m))
    monkeypatch.setitem(registry.SCHEDULES, "eager_1f1b", row)
    schedule = registry.build_schedule("eager_1f1b", 4, 8)
    assert schedule.compute_actions(0)[:5] == [F(0), F(1), F(2), F(3), F(4)]
    assert simulate(schedule, Costs.uniform(4, 1.0, 2.0)).step_time > 0
    assert in_flight("eager_1f1b", 4, 8) == ((5,), (4,), (3,), (2,))
    layers = [LayerProfile(f"l{i}", 1e-3, 2e-3, 100, 10, 10) for i in range(8)]
    plans = explore([Profile(2, "cpu", tuple(layers), 10)], 16, 4, ["1f1b", "eager_1f1b"], [8], Machine())
    assert plans["eager_1f1b"] is not None
    if find_spec("lightning") is not None:
        from lightning_pipe import PipeStrategy

        assert PipeStrategy(schedule="eager_1f1b").options.spec is row
