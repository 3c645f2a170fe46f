"""Seconds one process takes to write and to read back a ``torch.distributed.checkpoint`` directory of a given size.

    python benchmarks/checkpoint_io.py --mib 256 512 1024 --repeats 3

A sharded save or restore (``PipeStrategy(save_distributed_checkpoint=True)``, docs/large-models.md) has
each rank write or read only its own share. Whether its time then falls in proportion to the share
depends on one thing this script isolates: whether the writer's and the reader's cost is linear in the
bytes of one process. On a multi-rank job on one small machine the ranks share its cores and its disk,
so their times follow the machine's load (docs/memory.md); here one process writes ``--mib`` MiB of
64 MiB fp32 tensors (the layer size of ``benchmarks/large_models.py``'s model) with DCP's own writer,
then reads it back into tensors of the same shapes, the sizes interleaved round by round so that
machine noise hits all of them. Prints a markdown row per size: the median seconds, the MiB/s and the
ratio of the median to the smallest size's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

TENSOR_MIB = 64


def state(mib: int) -> dict[str, torch.Tensor]:
    """``mib`` MiB of fp32 tensors of ``TENSOR_MIB`` MiB each, with values (not zeros, which a writer may favour)."""
    count, numel = mib // TENSOR_MIB, TENSOR_MIB * 2**20 // 4
    return {f"layer{i}.weight": torch.rand(numel) for i in range(count)}


def timed_round(mib: int, root: str) -> tuple[float, float]:
    """Write ``mib`` MiB into a fresh directory under ``root`` and read it back: (write s, read s)."""
    tensors = state(mib)
    path = os.path.join(root, f"ckpt-{mib}")
    started = time.perf_counter()
    dcp.save(tensors, checkpoint_id=path, no_dist=True)
    os.sync()  # the bytes reach the disk, not only the page cache, within the timed save
    written = time.perf_counter() - started
    target = {name: torch.empty_like(t) for name, t in tensors.items()}
    del tensors
    started = time.perf_counter()
    dcp.load(target, checkpoint_id=path, no_dist=True)
    read = time.perf_counter() - started
    shutil.rmtree(path)
    return written, read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[256, 512, 1024], help="sizes, multiples of 64 MiB")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each round times every size once")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    if any(m % TENSOR_MIB for m in args.mib):
        parser.error(f"--mib takes multiples of {TENSOR_MIB}")
    root = tempfile.mkdtemp(dir=args.dir, prefix="checkpoint-io-")
    times: dict[int, list[tuple[float, float]]] = {m: [] for m in args.mib}
    load_before = os.getloadavg()[0]
    try:
        for round_ in range(args.repeats):
            order = args.mib if round_ % 2 == 0 else list(reversed(args.mib))
            for mib in order:
                times[mib].append(timed_round(mib, root))
                print(f"round {round_ + 1}/{args.repeats}: {mib} MiB written in {times[mib][-1][0]:.2f} s, "
                      f"read in {times[mib][-1][1]:.2f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nOne process, torch {torch.__version__}, load average {load_before:.1f} / {os.getloadavg()[0]:.1f}\n")
    print("| MiB | write s (median) | write MiB/s | write / smallest | read s (median) | read MiB/s | read / smallest |")
    print("|---|---|---|---|---|---|---|")
    base = min(args.mib)
    base_write = statistics.median(w for w, _ in times[base])
    base_read = statistics.median(r for _, r in times[base])
    for mib in args.mib:
        write = statistics.median(w for w, _ in times[mib])
        read = statistics.median(r for _, r in times[mib])
        print(f"| {mib} | {write:.2f} | {mib / write:.0f} | {write / base_write:.2f} | {read:.2f} | {mib / read:.0f} | "
              f"{read / base_read:.2f} |")


if __name__ == "__main__":
    main()
