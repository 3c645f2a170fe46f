"""Host memory of each rank of a pipeline whose model is larger than one rank's share (issue 28).

    python benchmarks/large_models.py --stages 2 --form init configure_model pretrained
    python benchmarks/large_models.py --stages 4 --form init configure_model
    python benchmarks/large_models.py --stages 2 4 --form configure_model --saves sharded --restore
    python benchmarks/large_models.py --stages 4 --form configure_model --saves sharded --vocab 16384

The model is a trunk of ``--depth`` × ``Linear(--width, --width)`` (default 16 × 4096: 1.0 GiB in fp32)
with a small input layer and head, trained a few steps with 1F1B and SGD with momentum on CPU ranks
(gloo). Each rank reads its resident memory (``/proc/self/status``: VmRSS now, VmHWM its peak): after
the imports (``imports``), when Lightning calls the module's ``setup`` hook, i.e. before the strategy's
setup (``before setup``), right after the strategy's setup (``after setup``: the cut and, for
``configure_model``, the materialisation), and at the end of training (``training``). Shares are the
bytes of the rank's own parameters.

The ``form`` says where the layers are built: in ``__init__`` (every rank first builds the whole
model, then drops the other stages' layers at setup) or in ``configure_model`` (on the meta device;
each rank creates only its own stage, replaying the other stages' initialisers one layer at a time).
``pretrained`` is the ``configure_model`` form that then loads its stage from safetensors shards (4
layers each, with the index json) with ``lightning_pipe.load_stage_weights`` in ``on_fit_start``
(``pretrained load``: that load's own peak, ``VmHWM`` reset before it).

After training each rank saves a sharded checkpoint (``save_distributed_checkpoint=True``) and then a
single file (``--saves``), and reports each save's own peak and seconds. Prints one markdown row per rank.

``--restore`` then starts a new job of the ``configure_model`` form that resumes the sharded checkpoint
(``fit(ckpt_path=directory)``) and reports, per rank, the bytes it reads (its share of the checkpoint:
its parameters and their optimizer state), the largest tensor among them, its resident memory before the
restore (after the strategy's setup: the share's parameters, not yet loaded), the restore's own peak
(``VmHWM`` reset before it), the memory after it and its seconds (from ``on_fit_start``, which runs after
setup and before the restore, to ``on_train_start``, which runs after it); the save's row beside it.
The load average (``/proc/loadavg``, 1 minute) is read at the start and the end of every job.

``--vocab V`` makes the model language-model shaped: an ``nn.Embedding(V, width)`` before the trunk and a
``Linear(width, V)`` head after it, both outside the trunk, so each rank's share column then counts the
parameters it really holds (the middle stages of the Sequential trunk hold one-element stand-ins for
them, docs/large-models.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def memory() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process, in MiB."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, amount, _ = line.split()
                values[key[:-1]] = int(amount) / 1024
    return values["VmRSS"], values["VmHWM"]


def reset_peak() -> None:
    """Start a new peak: ``VmHWM`` counts from now (Linux ``clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def load_average() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def checkpoint_share(module, optimizer) -> tuple[float, float]:
    """(MiB of this rank's parameters and their optimizer state, MiB of the largest such tensor)."""
    import torch

    tensors = [p for p in module.parameters()] + [v for state in optimizer.state.values()
                                                   for v in state.values() if isinstance(v, torch.Tensor)]
    sizes = [t.numel() * t.element_size() / 2**20 for t in tensors]
    return sum(sizes), max(sizes)


def run_rank(form: str, stages: int, width: int, depth: int, steps: int, out: str, saves: list[str], vocab: int = 0) -> None:
    """The training job (Lightning's launcher re-executes this for every other rank); ``form="restore"``:
    the ``configure_model`` form resuming ``out/sharded.ckpt``."""
    imports = memory()
    import time

    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipe import PipeStrategy

    imports = memory()  # after Lightning, torch and lightning_pipe

    class Big(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if form == "init":
                self.build()

        def build(self) -> None:
            torch.manual_seed(0)
            self.pre = nn.Embedding(vocab, width) if vocab else nn.Linear(16, width)
            self.model = nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))
            self.head = nn.Linear(width, vocab or 4)

        def configure_model(self) -> None:
            if form != "init" and not hasattr(self, "model"):  # restore: the configure_model form
                self.build()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.head(self.model(self.pre(x))), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)

    points: dict[str, tuple[float, float]] = {"imports": imports}

    class Probe(L.Callback):
        def setup(self, trainer, module, stage):
            points["before setup"] = memory()

        def on_fit_start(self, trainer, module):
            points["after setup"] = memory()
            if form == "restore":  # the restore comes next (it runs after setup, before on_train_start)
                trainer.strategy.barrier()
                reset_peak()
                self.started = time.perf_counter()
            if form == "pretrained":  # each rank reads its own tensors from the shards the driver wrote
                from lightning_pipe import load_stage_weights

                reset_peak()
                load_stage_weights(module, os.path.join(out, "weights"))
                points["load"] = memory()

        def on_train_start(self, trainer, module):
            if form != "restore":
                return
            seconds = {"restore": time.perf_counter() - self.started}
            points["restore"] = memory()
            share, largest = checkpoint_share(module, trainer.optimizers[0])
            record = {"rank": trainer.global_rank, "share": share, "largest": largest, "points": points,
                      "seconds": seconds, "load": [load, load_average()]}
            with open(os.path.join(out, f"restore{trainer.global_rank}.json"), "w") as f:
                json.dump(record, f)
            trainer.should_stop = True  # nothing to train: the restore was measured

        def on_train_end(self, trainer, module):
            if form == "restore":
                return
            points["training"] = memory()
            share = sum(p.numel() * p.element_size() for p in module.parameters()  # a stand-in holds one element
                        if p.untyped_storage().nbytes() >= p.numel() * p.element_size()) / 2**20
            ckpt_share, largest = checkpoint_share(module, trainer.optimizers[0])
            seconds = {}
            for kind in saves:  # each save's own peak, from what training left
                trainer.strategy.options = dataclasses.replace(trainer.strategy.options,
                                                               save_distributed_checkpoint=kind == "sharded")
                trainer.strategy.barrier()
                reset_peak()
                start = time.perf_counter()
                trainer.save_checkpoint(os.path.join(out, f"{kind}.ckpt"))
                seconds[kind] = time.perf_counter() - start
                points[f"{kind} save"] = memory()
            record = {"rank": trainer.global_rank, "share": share, "points": points, "seconds": seconds,
                      "checkpoint share": ckpt_share, "largest": largest, "load": [load, load_average()]}
            with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
                json.dump(record, f)

    load = load_average()
    restore = form == "restore"
    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, vocab, (8 * steps,), generator=g) if vocab else torch.randn(8 * steps, 16, generator=g)
    data = TensorDataset(inputs, torch.randint(0, vocab or 4, (8 * steps,), generator=g))
    strategy = PipeStrategy(schedule="1f1b", micro_batches=4, save_distributed_checkpoint=restore)
    trainer = L.Trainer(accelerator="cpu", devices=stages, strategy=strategy, max_steps=steps + restore, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Probe()])
    trainer.fit(Big(), DataLoader(data, batch_size=8), ckpt_path=os.path.join(out, "sharded.ckpt") if restore else None)


def save_shards(directory: str, width: int, depth: int) -> None:
    """The model's weights as Hugging Face lays them out: 4 layers per safetensors shard, and the index."""
    import torch
    from safetensors.torch import save_file
    from torch import nn

    os.makedirs(directory)
    torch.manual_seed(1)
    layers = {"pre": nn.Linear(16, width), "head": nn.Linear(width, 4)}
    weight_map, shards = {}, [{}]
    for name, layer in layers.items():
        shards[0].update({f"{name}.{k}": v for k, v in layer.state_dict().items()})
    for i in range(depth):  # one layer at a time: the driver never holds the whole trunk either
        if i % 4 == 0:
            shards.append({})
        shards[-1].update({f"model.{i}.{k}": v for k, v in nn.Linear(width, width).state_dict().items()})
        if i % 4 == 3 or i == depth - 1:
            file = f"model-{len(shards):05d}.safetensors"
            save_file(shards[-1], os.path.join(directory, file))
            weight_map.update({k: file for k in shards[-1]})
            shards[-1] = {}
    save_file(shards[0], os.path.join(directory, "model-00001.safetensors"))
    weight_map.update({k: "model-00001.safetensors" for k in shards[0]})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2])
    parser.add_argument("--form", nargs="+", default=["init", "configure_model"], choices=["init", "configure_model", "pretrained"])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=0,
                        help="an Embedding(vocab, width) input and a Linear(width, vocab) head outside the trunk (0: small ones)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--saves", nargs="+", default=["sharded", "file"], choices=["sharded", "file"],
                        help="the saves measured after training (the file save gathers the whole model on rank 0)")
    parser.add_argument("--restore", action="store_true",
                        help="then resume the sharded checkpoint in a new job and measure the restore")
    parser.add_argument("--rank-job", nargs=2, help=argparse.SUPPRESS)  # form, out: run one job
    args = parser.parse_args()
    if args.rank_job:
        form, out = args.rank_job
        run_rank(form, args.stages[0], args.width, args.depth, args.steps, out, args.saves, args.vocab)
        return
    if args.vocab and "pretrained" in args.form:
        parser.error("--vocab: the pretrained form's shards hold the small input layer and head")
    if args.restore and ("sharded" not in args.saves or "configure_model" not in args.form):
        parser.error("--restore resumes the sharded checkpoint of the configure_model form: keep both")
    trunk = args.width * (args.width + 1) * args.depth * 4 / 2**20
    outside = f"; Embedding({args.vocab}, {args.width}) and Linear({args.width}, {args.vocab}) outside it: " \
              f"{2 * args.vocab * args.width * 4 / 2**20:.0f} MiB" if args.vocab else ""
    print(f"trunk {args.depth} x Linear({args.width}, {args.width}): {trunk:.0f} MiB fp32{outside}; MiB per rank, RSS now / peak\n")
    print("| form | stages | rank | share | imports | before setup | after setup | pretrained load | training | "
          + " | ".join(f"{k} save" for k in args.saves) + " |")
    print("|---|---|---|---|---|---|---|---|---|" + "---|" * len(args.saves))
    restored = []
    for stages in args.stages:
        for form in args.form:
            with tempfile.TemporaryDirectory() as out:
                if form == "pretrained":
                    save_shards(os.path.join(out, "weights"), args.width, args.depth)
                command = [sys.executable, os.path.abspath(__file__), "--stages", str(stages), "--width", str(args.width),
                           "--depth", str(args.depth), "--steps", str(args.steps), "--vocab", str(args.vocab),
                           "--rank-job", form, out]
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                done = subprocess.run(command + ["--saves", *args.saves], capture_output=True, text=True,
                                      timeout=args.timeout, env=env)
                if done.returncode != 0:
                    raise SystemExit(done.stdout[-2000:] + done.stderr[-3000:])
                for rank in range(stages):
                    with open(os.path.join(out, f"rank{rank}.json")) as f:
                        record = json.load(f)
                    points = record["points"]
                    cells = " | ".join(f"{points[p][0]:.0f} / {points[p][1]:.0f}" if p in points else "-"
                                       for p in ("imports", "before setup", "after setup", "load", "training"))
                    cells += " | " + " | ".join(f"{record['points'][f'{k} save'][1]:.0f} MiB, {record['seconds'][k]:.1f} s"
                                                for k in args.saves)
                    name = {"init": "`__init__`", "configure_model": "`configure_model`",
                            "pretrained": "`configure_model` + `load_stage_weights`"}[form]
                    print(f"| {name} | {stages} | {rank} | {record['share']:.0f} | {cells} |", flush=True)
                if args.restore and form == "configure_model":
                    restored += restore_rows(command, env, args.timeout, stages, out)
    if restored:
        print("\nSharded save and restore, MiB per rank (checkpoint share: the rank's parameters and their optimizer "
              "state; RSS before -> peak (peak - before); load average at the job's start / end)\n")
        print("| stages | rank | checkpoint share | largest tensor | save: before -> peak | save s | save load avg "
              "| restore: before -> peak | after | restore s | restore load avg |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        print("\n".join(restored))


def restore_rows(command: list[str], env: dict[str, str], timeout: float, stages: int, out: str) -> list[str]:
    """Resume ``out/sharded.ckpt`` in a new job of the configure_model form; one row per rank beside its save."""
    command = [*command[:-2], "restore", out]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-3000:])
    rows = []
    for rank in range(stages):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            saved = json.load(f)
        with open(os.path.join(out, f"restore{rank}.json")) as f:
            restored = json.load(f)
        before, peak = saved["points"]["training"][0], saved["points"]["sharded save"][1]
        r_before, r_peak = restored["points"]["after setup"][0], restored["points"]["restore"][1]
        rows.append(
            f"| {stages} | {rank} | {saved['checkpoint share']:.0f} | {saved['largest']:.0f} | {before:.0f} -> {peak:.0f} "
            f"({peak - before:+.0f}) | {saved['seconds']['sharded']:.1f} | {saved['load'][0]:.1f} / {saved['load'][1]:.1f} "
            f"| {r_before:.0f} -> {r_peak:.0f} ({r_peak - r_before:+.0f}) | {restored['points']['restore'][0]:.0f} "
            f"| {restored['seconds']['restore']:.1f} | {restored['load'][0]:.1f} / {restored['load'][1]:.1f} |")
    return rows


if __name__ == "__main__":
    main()
