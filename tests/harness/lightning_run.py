"""A small Lightning training run, used both in-process (one-device reference) and as a script.

Lightning's launcher re-executes ``sys.argv`` for every extra rank, so multi-process runs must be a
script: ``python tests/harness/lightning_run.py CONFIG_JSON OUT_DIR``. Every rank writes what it saw to
``OUT_DIR/rank{r}.pt``: logged metrics per step, the loss returned per step, first-step
gradients, final local weights.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning_pipe  # noqa: E402  (registers the strategy names)
from lightning_pipe.engine.stand_ins import is_absent  # noqa: E402
from lightning_pipe.optim import BasisRotationAdam, CombinedOptimizer  # noqa: E402


def muon_with_adam(parameters) -> CombinedOptimizer:
    """Muon for the 2-D weights, Adam for the rest, as one optimizer (what the tests call "muon")."""
    parameters = list(parameters)
    return CombinedOptimizer(torch.optim.Muon([p for p in parameters if p.ndim == 2], lr=0.02, weight_decay=0.01),
                             torch.optim.Adam([p for p in parameters if p.ndim != 2], lr=1e-2))


class TrunkModel(L.LightningModule):
    """Layers before the trunk (first stage), an nn.Sequential trunk, a head after it (last stage)."""

    def __init__(self, width: int = 16, depth: int = 6, classes: int = 4, optimizer: str = "sgd", fail_at: int = -1,
                 fail_rank: int = -1, tie: bool = False, scheduler: bool | str = False, fail_hook: str | None = None,
                 fault: dict | None = None, configure: bool = False, overflow: dict | None = None, late_use: int = -1,
                 frozen: int = 0, stop_at_step: int = -1, stop_in_validation: bool = False, stop_rank: int = -1,
                 gather: bool = False, log_grad_norms: bool | str = False, logger_calls: bool = False,
                 mixup: bool = False, norms: bool = False):
        super().__init__()
        self.save_hyperparameters()
        self.tie, self.scheduler = tie, scheduler
        self.width, self.depth, self.classes = width, depth, classes
        self.frozen = frozen  # the input layer and this many trunk entries do not train (fine-tuning the rest)
        self.mixup = mixup  # the trunk has dropout, and training_step mixes the inputs and the labels (mixup)
        self.norms = norms  # BatchNorm without parameters before the trunk (first stage) and after it (last stage)
        if not configure:  # configure=True: the layers are built in configure_model, as for a large model
            self.build()
        self.optimizer = optimizer
        self.fail_at, self.fail_rank, self.fail_hook = fail_at, fail_rank, fail_hook
        self.fault = fault  # {"kind": "stop" | "kill" | "sleep", "rank": r, "step": s}: see inject()
        self.overflow = overflow  # {"param": name, "step": s[, "rank": r]}: that parameter's gradient is inf at step s
        self.late_use = late_use  # from this step on, the head's code also trains the input layer's bias (-1: never)
        self.stop_at_step = stop_at_step  # from this step on, training_step's code after the trunk sets trainer.should_stop
        self.stop_rank = stop_rank  # with stop_at_step: only this rank sets it, in code before the trunk (-1: after it)
        self.stop_in_validation = stop_in_validation  # validation_step sets trainer.should_stop (after the sanity check)
        self.gather = gather  # validation_step logs the mean and the size of self.all_gather(its loss)
        self.log_grad_norms = log_grad_norms  # on_before_optimizer_step ("after_backward": on_after_backward) logs grad_norm(self, 2)
        if log_grad_norms == "after_backward":  # where older Lightning recipes tracked gradients
            self.on_after_backward = self.log_grad_norms_after_backward
        self.logger_calls = logger_calls  # training_step (after the trunk) and on_before_optimizer_step call the loggers,
        self.val_outputs: list[torch.Tensor] = []  # ... and on_validation_epoch_end logs what validation_step collected
        self.mixup_draws: dict[float, list] = {}  # per micro-batch (its first input): the weight and permutation drawn
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=classes, average="micro")
        self.val_mae = torchmetrics.MeanAbsoluteError()

    def build(self):
        torch.manual_seed(0)
        self.pre = nn.Linear(8, self.width)
        self.model = nn.Sequential(*[m for _ in range(self.depth) for m in (nn.Linear(self.width, self.width), nn.Tanh())])
        if self.mixup:  # random numbers drawn inside the trunk, by its first stage only (as a stage's dropout would)
            self.model.insert(1, nn.Dropout(0.2))
        self.head = nn.Linear(self.width, self.classes)
        if self.norms:  # running statistics only: buffers no parameter's usage tells the owner of
            self.pre_norm, self.head_norm = nn.BatchNorm1d(self.width, affine=False), nn.BatchNorm1d(self.width, affine=False)
        for p in [*self.pre.parameters(), *self.model[:self.frozen].parameters()] if self.frozen else []:
            p.requires_grad_(False)

    def forward(self, x):
        return self.output(self.model(self.embed(x)))

    def embed(self, x):
        h = self.pre(x)
        return torch.relu(self.pre_norm(h) if self.norms else h)

    def output(self, h):
        # tie=True reuses the input layer's weight after the trunk (like a tied embedding / LM head)
        h = self.head_norm(h) if self.norms else h
        out = F.linear(h, self.pre.weight.t()) if self.tie else self.head(h)
        if 0 <= self.late_use <= self.global_step and self.training:
            out = out + self.pre.bias.sum() * 0.0  # a parameter the last stage starts to use after the first step
        return out

    def _fail_in(self, hook):
        if self.fail_hook == hook and self.global_rank == self.fail_rank:
            print(f"injecting raise on rank {self.global_rank} at step 0 at {time.time()}", flush=True)
            raise ZeroDivisionError(f"deliberate failure in {hook}")

    def setup(self, stage):
        self._fail_in("setup")
        self.inject("setup")  # a fault with "step": "setup" strikes before the first step

    def on_train_start(self):
        self._fail_in("on_train_start")
        if self.overflow is not None:  # only the rank (stage) holding the parameter overflows, or "rank" alone
            param = dict(self.named_parameters())[self.overflow["param"]]
            if not param.is_meta and self.overflow.get("rank", self.global_rank) == self.global_rank:
                param.register_hook(self._overflow)

    def _overflow(self, grad):
        return grad + float("inf") if self.trainer.global_step == self.overflow["step"] else grad

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        if self.gather:
            gathered = self.all_gather(F.cross_entropy(logits, y))
            self.log_dict({"val_gathered_mean": gathered.mean(), "val_gathered_size": float(gathered.numel())})
        if self.stop_in_validation and not self.trainer.sanity_checking:
            self.trainer.should_stop = True
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc)
        self.val_mae(logits.softmax(1).max(1).values, torch.ones_like(y, dtype=torch.float))
        self.log("val_mae", self.val_mae)
        if self.logger_calls:  # Lightning's recipe: collect in the step (the last stage), reduce at the epoch's end
            self.val_outputs.append(logits.detach())

    def on_validation_epoch_end(self):
        if self.logger_calls and self.val_outputs:  # where the step's outputs were collected
            every = torch.cat(self.val_outputs)
            self.log("val_max_logit", every.max())
            self.logger.log_metrics({"val_rows": float(len(every))}, step=self.global_step)
        self.val_outputs = []

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).softmax(1)

    def inject(self, batch_idx):
        """The fault of ``self.fault`` on its rank at its step: SIGSTOP (a hung process), SIGKILL, or a
        sleep inside the step (a hung Python)."""
        fault = self.fault
        if fault is None or batch_idx != fault["step"] or self.global_rank != fault["rank"]:
            return
        import signal

        at = -1 if batch_idx == "setup" else batch_idx  # setup: before the first step
        print(f"injecting {fault['kind']} on rank {self.global_rank} at step {at} at {time.time()}", flush=True)
        if fault["kind"] == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault["kind"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault["kind"] == "sleep":
            time.sleep(3600)
        elif fault["kind"] in ("sigterm", "sigint"):  # a scheduler's preemption, a Ctrl+C: to the whole process group
            os.killpg(os.getpgid(0), signal.SIGTERM if fault["kind"] == "sigterm" else signal.SIGINT)
        elif fault["kind"] == "sigterm_self":  # SIGTERM to this rank's process alone
            os.kill(os.getpid(), signal.SIGTERM)

    def training_step(self, batch, batch_idx):
        self.inject(batch_idx)
        if batch_idx == self.fail_at and self.global_rank == self.fail_rank:
            print(f"injecting raise on rank {self.global_rank} at step {batch_idx} at {time.time()}", flush=True)
            raise ZeroDivisionError(f"deliberate failure at batch {batch_idx}")
        if 0 <= self.stop_at_step <= self.global_step and self.global_rank == self.stop_rank:
            self.trainer.should_stop = True
        x, y = batch
        if self.mixup:  # the first stage mixes the inputs with these draws, the last stage the labels
            lam, order = float(np.random.beta(0.4, 0.4)), torch.randperm(len(x))
            self.mixup_draws.setdefault(float(x[0, 0]), []).append((lam, order.tolist()))
            x = lam * x + (1 - lam) * x[order]
        logits = self.output(self.model(self.embed(x)))
        loss = F.cross_entropy(logits, y)
        if self.mixup:
            loss = lam * loss + (1 - lam) * F.cross_entropy(logits, y[order])
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", (logits.argmax(1) == y).float().mean())
        self.log("seen", float(len(y)), reduce_fx="sum")
        if 0 <= self.stop_at_step <= self.global_step and self.stop_rank < 0:
            self.trainer.should_stop = True
        if self.logger_calls:  # the batch's first logit, straight to the CSV logger and to TensorBoard's writer
            first = float(logits[0, 0])
            self.logger.log_metrics({"first_logit": first}, step=self.global_step)
            self.loggers[1].experiment.add_scalar("first_logit_tb", first, self.global_step)
        return loss

    def log_grad_norms_after_backward(self):  # on_after_backward where asked, so that other runs gather nothing there
        self.log_dict(grad_norm(self, norm_type=2))

    def on_before_optimizer_step(self, optimizer):
        if self.log_grad_norms is True:  # Lightning's recipe for tracking gradients
            self.log_dict(grad_norm(self, norm_type=2))
        if self.logger_calls:  # every rank its own stage's gradients, straight to TensorBoard's writer
            for name, p in self.named_parameters():
                if p.grad is not None:
                    self.loggers[1].experiment.add_scalar(f"grad_sum/{name}", float(p.grad.sum()), self.global_step)

    def configure_optimizers(self):
        if self.optimizer == "adam":
            optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        elif self.optimizer == "adam_foreach":  # the multi-tensor update CUDA defaults to, on the CPU too
            optimizer = torch.optim.Adam(self.parameters(), lr=1e-2, foreach=True)
        elif self.optimizer == "muon":
            optimizer = muon_with_adam(self.parameters())
        elif self.optimizer == "basis_rotation":  # the matrices in their eigenbasis, Adam for the rest
            matrices = [p for p in self.parameters() if p.ndim == 2]
            optimizer = CombinedOptimizer(BasisRotationAdam(matrices, lr=1e-2),
                                          torch.optim.Adam([p for p in self.parameters() if p.ndim != 2], lr=1e-2))
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        if not self.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        interval = self.scheduler if isinstance(self.scheduler, str) else "epoch"
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": interval}}


class ConfiguredTrunkModel(TrunkModel):
    """TrunkModel with its layers built in ``configure_model``, as Lightning recommends for large models."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{**kwargs, "configure": True})

    def configure_model(self):
        if not hasattr(self, "model"):  # idempotent: Lightning calls it on every fit / validate / test
            self.build()


class Recorder(L.Callback):
    def __init__(self):
        self.val_metrics: list[dict[str, float]] = []
        self.metrics: list[dict[str, float]] = []
        self.returned: list[float] = []
        self.first_grads: dict[str, torch.Tensor] = {}
        self.scales: list[float] = []
        self.labels: list[list[int]] = []  # every training batch's labels, as this rank's DataLoader gave them

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if not self.first_grads:
            self.first_grads = {n: whole(p.grad) for n, p in module.named_parameters() if p.grad is not None}

    def on_validation_end(self, trainer, module):
        if not trainer.sanity_checking:
            self.val_metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")})

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:  # fp16 loss scaling: the scale after this step's update
            self.scales.append(float(scaler.get_scale()))
        self.returned.append(float(outputs["loss"]))
        if isinstance(batch, (list, tuple)) and len(batch) == 2:  # (inputs, labels); the token windows are one tensor
            self.labels.append(batch[1].tolist())


class Losses(L.Callback):
    """The logged ``train_loss`` of every step."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


class SlowCheckpointIO(TorchCheckpointIO):
    """A filesystem that takes ``seconds`` to write a checkpoint; with ``kill``, the writing process is
    killed (SIGKILL) half-way through the file."""

    def __init__(self, seconds: float, kill: bool = False):
        super().__init__()
        self.seconds, self.kill = seconds, kill

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        with open(path, "wb") as f:
            f.write(b"half a checkpoint")
        if self.kill:
            import signal

            print(f"injecting kill on rank 0 at step -1 at {time.time()} while writing {path}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.seconds)
        super().save_checkpoint(checkpoint, path, storage_options)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor``, gathered whole where it is a shard (``data_parallel="fsdp"``: a collective over the
    copies of the stage, which every one of them calls in the same order)."""
    return tensor.full_tensor().detach().clone() if isinstance(tensor, DTensor) else tensor.detach().clone()


def make_data(n: int = 96, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    return TensorDataset(x, y)


def masking_collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack the samples and replace a random third of the labels by 0, as a masked language model's collate masks tokens
    (random numbers drawn in the DataLoader's worker)."""
    x, y = torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])
    return x, torch.where(torch.rand(len(y)) < 0.3, torch.zeros_like(y), y)


def train(config: dict[str, Any]) -> dict[str, Any]:
    """Train per ``config``; return this rank's record."""
    masking_workers = config.get("masking_workers", False)  # a worker's random masking, seeded by seed_everything(workers=True)
    L.seed_everything(0, verbose=False, workers=masking_workers)
    if "hf" in config:  # a tiny Hugging Face model (tests/harness/hf_models.py) on random token windows
        from tests.harness.hf_models import HFCausalLM, token_windows

        model: L.LightningModule = HFCausalLM(config["hf"])
        data = token_windows
    elif "pretrained" in config:  # {"path": a save_pretrained directory, "per_stage": bool}
        from tests.harness.hf_models import PretrainedLlama, token_windows

        model, data = PretrainedLlama(**config["pretrained"]), token_windows
    else:
        options = dict(config.get("model", {}))
        model_class = ConfiguredTrunkModel if options.pop("configure", False) else TrunkModel
        model, data = model_class(**options), make_data
    strategy = config.get("strategy")
    if isinstance(strategy, dict):
        io = SlowCheckpointIO(config["slow_save"], config.get("kill_in_save", False)) if "slow_save" in config else None
        strategy = lightning_pipe.PipeStrategy(**strategy, checkpoint_io=io)
    recorder = Recorder()
    callbacks, logger = [recorder], False
    if config.get("on_exception_ckpt"):  # a directory: Lightning's OnExceptionCheckpoint writes there
        from lightning.pytorch.callbacks import OnExceptionCheckpoint

        callbacks.append(OnExceptionCheckpoint(config["on_exception_ckpt"]))
    if config.get("every_step_ckpt"):  # a directory: a ModelCheckpoint saving every training step
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(config["every_step_ckpt"], every_n_train_steps=1, save_top_k=-1, filename="{step}"))
    if config.get("full_callbacks"):  # a directory: the usual Lightning callbacks and a CSV logger
        from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
        from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

        root = config["full_callbacks"]
        logger = [CSVLogger(root, name="csv", version=0), TensorBoardLogger(root, name="tb", version=0)]
        callbacks += [
            ModelCheckpoint(os.path.join(root, "best"), monitor="val_loss", save_top_k=2, save_last=True,
                            filename="{epoch}-{step}-{val_loss:.4f}"),
            ModelCheckpoint(os.path.join(root, "every"), every_n_train_steps=4, save_top_k=-1, filename="{step}"),
            EarlyStopping(monitor="val_loss", patience=1, min_delta=0.01),
            LearningRateMonitor(logging_interval="step"),
        ]
    options = dict(
        accelerator=config.get("accelerator", "cpu"),
        devices=config.get("devices", 1),
        strategy=strategy or "auto",
        max_epochs=config.get("epochs", 1),
        max_steps=config.get("max_steps", -1),
        logger=logger,
        enable_checkpointing=bool(config.get("full_callbacks") or config.get("every_step_ckpt") or config.get("on_exception_ckpt")),
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=callbacks,
    )
    if config.get("fp16_cpu"):  # Lightning turns precision="16-mixed" on the CPU into bf16: fp16 with a CPU GradScaler
        from lightning.pytorch.plugins import MixedPrecision

        options["plugins"] = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]
    trainer = L.Trainer(**{**options, **config.get("trainer", {})})
    dataset = data(config.get("samples", 96))
    if config.get("shard_by_rank"):  # a dataset that shards itself by global rank, as under DDP: each stage its own half
        dataset = torch.utils.data.Subset(dataset, range(trainer.global_rank, len(dataset), trainer.world_size))
    if trainer.global_rank == config.get("short_rank"):  # that rank's DataLoader gives the same batches but one fewer
        dataset = torch.utils.data.Subset(dataset, range(len(dataset) - config.get("batch_size", 16)))
    sampler = None
    pipelines = config.get("pipelines_in_sampler", 1)
    if pipelines > 1:
        sampler = DistributedSampler(dataset, num_replicas=pipelines, rank=trainer.global_rank // config["stages"], shuffle=False)
    masking = {"num_workers": 1, "collate_fn": masking_collate} if masking_workers else {}
    if config.get("masking_main"):  # the same random masking in the main process (num_workers=0)
        masking = {"collate_fn": masking_collate}
    loader = DataLoader(dataset, batch_size=config.get("batch_size", 16), shuffle=False, sampler=sampler, **masking)
    eval_loader = DataLoader(data(config.get("eval_samples", 40), seed=1), batch_size=config.get("eval_batch_size", 12))
    evaluate = config.get("evaluate", False)
    validate_during_fit = evaluate or bool(config.get("full_callbacks"))
    groups = GroupCount() if config.get("count_groups") else None
    try:
        trainer.fit(model, loader, eval_loader if validate_during_fit else None, ckpt_path=config.get("ckpt_path"))
        results = run_after_fit(config, trainer, model, eval_loader, groups)
    finally:
        if groups is not None:
            groups.restore()
        os.environ.pop("PL_SEED_WORKERS", None)  # a pool's worker runs the next job in the same process
    return {**results, **record_of(recorder, trainer, model)}


class GroupCount:
    """Counts ``torch.distributed.new_group`` calls until :meth:`restore`."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.made, self.original = 0, dist.new_group

        def counting(*args, **kwargs):
            self.made += 1
            return self.original(*args, **kwargs)

        dist.new_group = counting

    def restore(self) -> None:
        import torch.distributed as dist

        dist.new_group = self.original


def run_after_fit(config: dict[str, Any], trainer: L.Trainer, model: L.LightningModule, eval_loader: DataLoader,
                  groups: GroupCount | None) -> dict[str, Any]:
    """What the config asks for after ``trainer.fit``: a checkpoint, validate / test / predict, the best checkpoints."""
    if config.get("ckpt_out"):
        trainer.save_checkpoint(config["ckpt_out"])
    results: dict[str, Any] = {}
    if groups is not None:
        results["groups_made_by_fit"] = groups.made
    if config.get("evaluate", False):
        results["validate"] = trainer.validate(model, eval_loader, verbose=False)
        results["test"] = trainer.test(model, eval_loader, verbose=False)
        results["predict"] = trainer.predict(model, eval_loader)
    if groups is not None:
        results["groups_made_after_fit"] = groups.made - results["groups_made_by_fit"]
    if config.get("full_callbacks"):
        best = trainer.checkpoint_callbacks[0]
        results["checkpointing"] = {"best_score": float(best.best_model_score), "best_k": sorted(
            os.path.basename(k) for k in best.best_k_models), "stopped_epoch": trainer.current_epoch}
    return results


def record_of(recorder: Recorder, trainer: L.Trainer, model: L.LightningModule) -> dict[str, Any]:
    """This rank's record of the run."""
    return {
        "val_metrics": recorder.val_metrics,
        "rank": trainer.global_rank,
        "metrics": recorder.metrics,
        "returned": recorder.returned,
        "labels": recorder.labels,
        "mixup_draws": getattr(model, "mixup_draws", {}),
        "scales": recorder.scales,
        "grads": recorder.first_grads,
        "state": {k: whole(v) for k, v in model.state_dict().items()},
        "sharded": sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor)),
        "global_step": trainer.global_step,
        "counts": getattr(trainer.strategy, "layer_counts", None),
        "avgpipe": avgpipe_values(trainer.strategy),
        "transport": transport_of(trainer.strategy),
        "absent": sorted(name for name, tensor in model.state_dict(keep_vars=True).items() if is_absent(tensor)),  # stand-ins
    }


def transport_of(strategy: Any) -> tuple[str, list[int]] | None:
    """The strategy's transport class, and the ranks it reaches through shared memory."""
    transport = strategy.transport() if hasattr(strategy, "transport") else None
    return (type(transport).__name__, sorted(getattr(transport, "peers", {}))) if transport is not None else None


def avgpipe_values(strategy: Any) -> tuple[int, int, int] | None:
    """``(parallel_pipelines, micro_batches, advance_forward)`` of an avgpipe strategy (after any tuning)."""
    if getattr(strategy, "schedule", None) != "avgpipe":
        return None
    return strategy.options.avgpipe.parallel_pipelines, strategy.micro_batches, strategy.options.avgpipe.advance_forward


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    result = train(config)
    torch.save(result, os.path.join(sys.argv[2], f"rank{result['rank']}.pt"))
