"""``PipeStrategy``'s options are explicit: ``inspect.signature`` shows each, typed, with its default, and
``PipeOptions`` is built from them by name."""

from __future__ import annotations

import inspect

import pytest
from lightning.pytorch.strategies import DDPStrategy

from lightning_pipe import PipeConfigError, PipeStrategy
from lightning_pipe.lightning import options as options_module

#: The Lightning plugins the Trainer sets; every other parameter is an option of the pipeline.
LIGHTNING = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin", "process_group_backend"}


def test_signature_shows_every_option_typed_with_its_default():
    parameters = inspect.signature(PipeStrategy).parameters
    assert "self" not in parameters and not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters.values())
    untyped = [name for name, p in parameters.items() if p.annotation is inspect.Parameter.empty]
    no_default = [name for name, p in parameters.items() if p.default is inspect.Parameter.empty]
    assert not untyped and not no_default, (untyped, no_default)
    assert parameters["micro_batches"].default == 4 and parameters["timeout"].annotation is float
    assert set(parameters) == set(options_module.FIELDS) | set(options_module.DEPRECATED) | LIGHTNING
    assert "micro_batches" in inspect.signature(PipeStrategy).parameters  # a class attribute, not cached per call


def test_a_typo_still_names_the_option_meant():
    with pytest.raises(PipeConfigError, match=r"has no option 'chunks_per_stages'; did you mean chunks_per_stage=\?"):
        PipeStrategy(chunks_per_stages=2)


def test_pipe_options_are_built_by_name():
    defaults = options_module.resolve({})
    assert defaults == PipeStrategy().options
    options = options_module.resolve({"schedule": "interleaved_1f1b", "balance": (1, 2), "timeout": 5, "xpipe": None})
    assert options.chunks_per_stage == 2 and options.balance == [1, 2] and options.timeout == 5.0
    with pytest.raises(TypeError, match="no field micro_batch"):
        options_module.resolve({"micro_batch": 4})


def test_the_lightning_base_is_not_asked_for_the_signature():
    # DDPStrategy's own signature is left alone by PipeStrategy's
    assert "ddp_comm_hook" in inspect.signature(DDPStrategy).parameters


def test_a_group_the_run_will_not_read_is_named_in_a_warning(recwarn):
    """``pipemare=...`` with ``schedule="xpipe"`` (a schedule changed without its group) trains as if it were not
    there: the warning says so and what to change. A group left at its defaults, as LightningCLI passes it, is quiet."""
    with pytest.warns(UserWarning, match=r"xpipe=\.\.\. is ignored, since schedule='pipemare' does not read it; use schedule='xpipe'"):
        PipeStrategy(schedule="pipemare", xpipe={"prediction": "sgd"})
    with pytest.warns(UserWarning, match=r"auto_balance=\.\.\. is ignored, since balance='uniform'; use balance='auto'"):
        PipeStrategy(schedule="1f1b", auto_balance={"refine": False})
    recwarn.clear()
    PipeStrategy(schedule="pipemare", pipemare={"correction": False}, xpipe={}, balance="auto", auto_balance={"refine": False})
    assert not [w for w in recwarn if "is ignored" in str(w.message)]
