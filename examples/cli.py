"""Pipeline-parallel training from the command line with LightningCLI.

    python examples/cli.py fit --config examples/configs/1f1b.yaml
    python examples/cli.py fit --config examples/configs/1f1b.yaml --trainer.max_steps=20
    python examples/cli.py fit --trainer.strategy.class_path=lightning_pipe.PipeStrategy --print_config

The model and data are examples/demo.py's MLPClassifier and examples/datasets.py's
ClassificationDataModule; the model's input and output sizes come from the data. Importing
lightning_pipe registers the strategy names, so ``trainer.strategy: 1f1b`` works; the
``class_path: lightning_pipe.PipeStrategy`` form works with or without that import, and takes the
option groups as nested blocks (``avgpipe: {parallel_pipelines: auto}``; docs/cli.md).

Lightning's launcher re-runs this script (same ``sys.argv``) in every worker process, so all the
work happens under ``if __name__ == "__main__"``.
"""

import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

try:
    import lightning_pipe  # noqa: F401  (registers every schedule name: "gpipe", "1f1b", ..., "avgpipe")
except ModuleNotFoundError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import lightning_pipe  # noqa: F401

from datasets import ClassificationDataModule
from demo import MLPClassifier


class PipeCLI(LightningCLI):
    def add_arguments_to_parser(self, parser):
        # the model's sizes are read from the data module once it exists
        parser.link_arguments("data.num_features", "model.num_features", apply_on="instantiate")
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")


def main():
    PipeCLI(
        MLPClassifier,
        ClassificationDataModule,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},  # re-runs into the same directory are fine
    )


if __name__ == "__main__":
    main()
