"""Finding the trunk: the ``nn.Sequential`` of a LightningModule that the pipeline splits."""

from __future__ import annotations

from torch import nn

from lightning_pipe.errors import TrunkError


def find_trunk(module: nn.Module, name: str | None = None) -> tuple[str, nn.Sequential]:
    """Return ``(attribute_path, sequential)`` of the trunk.

    Args:
        module: the (Lightning) module.
        name: dotted attribute path of the trunk; ``None`` picks the single ``nn.Sequential``
            attribute of ``module``.
    """
    if name is not None:
        target: object = module
        for part in name.split("."):
            if not hasattr(target, part):
                raise TrunkError(
                    f"{type(module).__name__} has no attribute {name!r}; set PipeStrategy(module=...) to the name "
                    f"of its nn.Sequential trunk ({_describe(_candidates(module))})."
                )
            target = getattr(target, part)
        if not isinstance(target, nn.Sequential):
            raise TrunkError(
                f"{type(module).__name__}.{name} is a {type(target).__name__}, not an nn.Sequential; "
                "wrap the pipelined layers in one nn.Sequential."
            )
        return name, target
    candidates = _candidates(module)
    if len(candidates) == 1:
        return candidates[0], getattr(module, candidates[0])
    if not candidates:
        raise TrunkError(
            f"{type(module).__name__} has no nn.Sequential attribute to split into pipeline stages; "
            "put the layers to pipeline in one nn.Sequential attribute (e.g. self.model = nn.Sequential(...))."
        )
    raise TrunkError(
        f"{type(module).__name__} has several nn.Sequential attributes ({', '.join(candidates)}); "
        "name the one to pipeline with PipeStrategy(module=...)."
    )


def _candidates(module: nn.Module) -> list[str]:
    return [name for name, child in module.named_children() if isinstance(child, nn.Sequential)]


def _describe(candidates: list[str]) -> str:
    return f"candidates: {', '.join(candidates)}" if candidates else "it has no nn.Sequential attribute"
