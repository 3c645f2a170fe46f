"""Inject faults into 2-process training jobs and tabulate how every rank ends (docs/failures.md).

    python benchmarks/faults.py --runs 3 --timeout 10

Each case runs ``tests/harness/lightning_run.py`` (the test suite's small model, 1F1B on 2 CPU processes)
in a session of its own with one fault: a rank stopped (SIGSTOP: hung outside Python), killed
(SIGKILL), asleep inside its step (hung in Python), raising in its step or in a hook, at start-up, a
checkpoint save slower than the pipeline ``timeout``, a rank killed in the middle of a checkpoint
save; at start-up, MASTER_PORT taken (by a listening and a non-listening holder) and a lone rank whose
rank 0 never comes (``startup_timeout=5``), a rank 0 hung in its ``balance="auto"`` profile; SIGTERM and
SIGINT to the job's process group, with and without the callbacks that write a checkpoint then, and
SIGTERM during start-up; resuming from a truncated checkpoint, one of another layer width and one of
another asynchronous schedule (for the start-up and checkpoint cases the seconds count from the job's
start, not from a fault). Per run it records how the job ended, the seconds from the fault to the last process of the
job gone, whether a surviving rank's error names the failed rank, the processes of the job still
alive afterwards (orphans; exited-but-unreaped zombies excluded) and, for the save cases, whether the
checkpoint was written and whether a leftover temporary file survived the next save.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.harness.faults import cases, run  # noqa: E402  (the test suite's fault harness, one implementation)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per case")
    parser.add_argument("--timeout", type=float, default=10.0, help="PipeStrategy(timeout=...) of every job")
    parser.add_argument("--cases", nargs="*", help="substrings of the case names to run (default: all)")
    args = parser.parse_args()
    limit = args.timeout * 6 + 120
    print(f"Each job: 2 CPU processes, 1F1B, timeout={args.timeout:g} s; {args.runs} runs per case.\n")
    print("| case | ended | seconds after the fault (per run) | failed rank named (or the stop said) | orphans | checkpoint |")
    print("|---|---|---|---|---|---|")
    for case in cases(args.timeout):
        if args.cases and not any(s in case.name for s in args.cases):
            continue
        outcomes = [run(case, limit) for _ in range(args.runs)]
        codes = sorted({str(o.code) for o in outcomes})
        ended = ("ok" if codes == ["0"] else f"exit {', '.join(codes)}") if "hung" not in codes else "HUNG"
        seconds = ", ".join("-" if o.seconds is None else f"{o.seconds:.1f}" for o in outcomes)
        named = ("-" if case.failed_rank is None and case.says is None
                 else f"{sum(bool(o.named) for o in outcomes)}/{len(outcomes)}")
        orphans = sum(len(o.orphans) for o in outcomes)
        checkpoint = "-" if not case.checkpoint else f"{sum(bool(o.checkpoint_ok) for o in outcomes)}/{len(outcomes)} written"
        if case.damaged is not None:
            checkpoint = f"{sum(bool(o.checkpoint_ok) for o in outcomes)}/{len(outcomes)} left as it was"
        print(f"| {case.name} | {ended} | {seconds} | {named} | {orphans} | {checkpoint} |", flush=True)


if __name__ == "__main__":
    main()
