"""Fault injection into 2-process training jobs (tests/distributed/test_faults.py; the table of docs/failures.md
comes from benchmarks/faults.py, which runs every case several times).

Each case runs ``tests/harness/lightning_run.py`` (the suite's small model, 1F1B on 2 CPU processes) in a
session of its own with one fault. :func:`run` records how the job ended, the seconds from the
fault to the last process of the job gone, whether a surviving rank's error names the failed rank,
the job's processes still alive afterwards (orphans; zombies excluded) and, for the save cases,
whether the checkpoint was written and no temporary file survived.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from tests.harness.distributed import job_environment

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_run.py")


@dataclass
class Case:
    """One fault: the job's config and what a correct ending looks like."""

    name: str
    config: dict
    failed_rank: int | None = None  # the rank a survivor's error must name
    expect_success: bool = False
    checkpoint: bool = False  # the case writes ckpt_out and must leave it loadable
    notes: str = ""
    port_holder: str | None = None  # "listening" or "bound": a socket of this process holds MASTER_PORT
    lone_rank: int | None = None  # start only this rank, as torchrun would (its rank 0 never comes)
    says: str | None = None  # words the output must hold (counted as "named")
    written: str | None = None  # a glob under the job's directory that must match a loadable checkpoint
    damaged: tuple[dict, str] | None = None  # (the config that writes <out>/given.ckpt first, the damage) to resume from


def cases(timeout: float) -> list[Case]:
    strategy = {"schedule": "1f1b", "timeout": timeout}
    base = {"devices": 2, "max_steps": 6, "batch_size": 16, "strategy": strategy}

    def fault(kind: str, rank: int) -> dict:
        return {**base, "model": {"fault": {"kind": kind, "rank": rank, "step": 2}}}

    return [
        Case("rank 0 stopped (SIGSTOP)", fault("stop", 0), failed_rank=0),
        Case("rank 1 stopped (SIGSTOP)", fault("stop", 1), failed_rank=1),
        Case("rank 1 asleep in its step", fault("sleep", 1), failed_rank=1),
        Case("rank 0 killed (SIGKILL)", fault("kill", 0), failed_rank=0, notes="rank 1's own parent is gone"),
        Case("rank 1 killed (SIGKILL)", fault("kill", 1), failed_rank=1),
        Case("rank 1 killed (SIGKILL), over gloo", {**fault("kill", 1), "strategy": {**strategy, "transport": "process_group"}},
             failed_rank=1, notes="transport='process_group': the connection closes"),
        Case("rank 0 raises in its step", {**base, "model": {"fail_at": 2, "fail_rank": 0}}, failed_rank=0),
        Case("rank 1 raises in its step", {**base, "model": {"fail_at": 2, "fail_rank": 1}}, failed_rank=1),
        Case("rank 0 raises in on_train_start", {**base, "model": {"fail_hook": "on_train_start", "fail_rank": 0}},
             failed_rank=0, notes="rank 0 holds the key-value store its report goes to"),
        Case("rank 1 raises in on_train_start", {**base, "model": {"fail_hook": "on_train_start", "fail_rank": 1}},
             failed_rank=1),
        Case("rank 1 raises in setup (start-up)", {**base, "model": {"fail_hook": "setup", "fail_rank": 1}}, failed_rank=1),
        Case(f"checkpoint save slower than timeout ({timeout * 1.5:.0f} s)",
             {**base, "max_steps": 2, "slow_save": timeout * 1.5, "ckpt_out": "<ckpt>"}, expect_success=True,
             checkpoint=True),
        *startup_cases(base),
        auto_balance_hang_case(base),
        *sigterm_cases(base),
        *startup_sigterm_cases(base),
        *sigint_cases(base),
        *checkpoint_cases(base),
        Case("rank 0 killed while saving, then the next job saves there",
             {**base, "max_steps": 2, "slow_save": 0, "kill_in_save": True, "ckpt_out": "<ckpt>"}, failed_rank=0,
             checkpoint=True, notes="the second job"),
    ]


def startup_cases(base: dict, startup_timeout: float = 5.0) -> list[Case]:
    """Faults before training: the port taken, a rank whose rank 0 never comes (issue 29)."""
    config = {**base, "strategy": {**base["strategy"], "startup_timeout": startup_timeout}}
    return [
        Case("MASTER_PORT taken by a listening process", config, port_holder="listening"),
        Case("MASTER_PORT taken by a non-listening socket", config, port_holder="bound"),
        Case(f"a lone rank 1, nothing at MASTER_PORT (startup_timeout={startup_timeout:g})", config, lone_rank=1),
        Case(f"a lone rank 1, another program at MASTER_PORT (startup_timeout={startup_timeout:g})", config, lone_rank=1,
             port_holder="listening"),
    ]


def auto_balance_hang_case(base: dict, startup_timeout: float = 60.0) -> Case:
    """Rank 0 hangs while it profiles the first batch for ``balance="auto"`` (its step sleeps): rank 1, waiting
    for the plan, gives up after ``startup_timeout`` (the start-up's bound; long enough for the imports of a
    loaded machine) and names it; the reaper ends the hung rank 0."""
    config = {**base, "strategy": {**base["strategy"], "balance": "auto", "startup_timeout": startup_timeout},
              "model": {"fault": {"kind": "sleep", "rank": 0, "step": 0}}}
    return Case(f"rank 0 hangs profiling for balance='auto' (startup_timeout={startup_timeout:g})", config, failed_rank=0,
                notes="its first step, run by the profiler, sleeps")


def checkpoint_cases(base: dict) -> list[Case]:
    """Resuming from a checkpoint that cannot serve (issue 29): cut in half, of another layer width, or holding
    another asynchronous schedule's weight-policy state. Each fails at the load, naming the file and the cause,
    and leaves the file as it was."""
    resume = {**base, "ckpt_path": "<out>/given.ckpt"}
    writer = {**base, "max_steps": 2, "ckpt_out": "<out>/given.ckpt"}
    two_bw = {**writer, "strategy": {**base["strategy"], "schedule": "pipedream_2bw"}}
    return [
        Case("a truncated checkpoint", resume, damaged=(writer, "truncate"), says="CheckpointFileError: cannot read the checkpoint"),
        Case("a checkpoint of another layer width", resume, damaged=({**writer, "model": {"width": 24}}, ""),
             says="mismatched shapes"),
        Case("a checkpoint of another asynchronous schedule", {**resume, "strategy": {**base["strategy"], "schedule": "pipemare"}},
             damaged=(two_bw, ""), says="which schedule='pipemare' cannot continue from"),
    ]


def sigterm_cases(base: dict) -> list[Case]:
    """SIGTERM to the job's whole process group at step 2 (a preemption), with and without the callbacks
    that write a checkpoint then (issue 29)."""
    config = {**base, "max_steps": 12, "model": {"fault": {"kind": "sigterm", "rank": 0, "step": 2}}}
    on_exception = {"on_exception_ckpt": "<out>/exc"}
    every_step = {"every_step_ckpt": "<out>/steps"}
    stopped = "the job stopped on SIGTERM at step "
    return [
        Case("SIGTERM, no checkpoint callback", config, says=stopped, notes="exit 0, as Lightning's own stop"),
        Case("SIGTERM with OnExceptionCheckpoint", {**config, **on_exception}, says=stopped, written="exc/on_exception.ckpt",
             checkpoint=True),
        Case("SIGTERM with ModelCheckpoint (every step)", {**config, **every_step}, says=stopped, written="steps/*.ckpt",
             checkpoint=True),
        Case("SIGTERM with both", {**config, **on_exception, **every_step}, says=stopped, written="exc/on_exception.ckpt",
             checkpoint=True),
    ]


def startup_sigterm_cases(base: dict) -> list[Case]:
    """SIGTERM during start-up (in the module's ``setup``, before the first step): there is nothing to save, so
    every rank ends at once, with exit 143 and a sentence, whether a checkpoint callback is configured or not."""
    config = {**base, "max_steps": 12, "on_exception_ckpt": "<out>/exc"}
    says = "received SIGTERM during start-up, before the first step"
    return [
        Case("SIGTERM during start-up", {**config, "model": {"fault": {"kind": "sigterm", "rank": 0, "step": "setup"}}},
             says=says, notes="exit 143: nothing to checkpoint yet"),
        Case("SIGTERM to rank 0 alone during start-up",
             {**config, "model": {"fault": {"kind": "sigterm_self", "rank": 0, "step": "setup"}}}, says=says,
             notes="rank 0 passes it on to the rank it started"),
    ]


def sigint_cases(base: dict) -> list[Case]:
    """SIGINT (Ctrl+C) to the job's whole process group at step 2: Lightning's own handling (benchmark only)."""
    config = {**base, "max_steps": 12, "model": {"fault": {"kind": "sigint", "rank": 0, "step": 2}}}
    return [
        Case("SIGINT, no checkpoint callback", config, says="KeyboardInterrupt"),
        Case("SIGINT with OnExceptionCheckpoint", {**config, "on_exception_ckpt": "<out>/exc"}, says="KeyboardInterrupt",
             written="exc/on_exception.ckpt", checkpoint=True),
    ]


@dataclass
class Outcome:
    code: int | str
    seconds: float | None  # from the fault to the job's end
    named: bool | None
    orphans: list[int] = field(default_factory=list)
    checkpoint_ok: bool | None = None
    sentence: str | None = None  # the last lightning_pipe error line of the output
    output: str = field(default="", repr=False)


def _loads(path: str) -> bool:
    try:
        return "state_dict" in torch.load(path, weights_only=True)
    except Exception:
        return False


def _job_processes(session: int) -> list[int]:
    """Live, non-zombie processes of the session ``session``."""
    listing = subprocess.run(["ps", "-eo", "pid,sid,stat"], capture_output=True, text=True).stdout.splitlines()[1:]
    return [int(pid) for pid, sid, stat in (line.split()[:3] for line in listing) if int(sid) == session and not stat.startswith("Z")]


def run(case: Case, limit: float) -> Outcome:
    with tempfile.TemporaryDirectory() as out:
        config = json.loads(json.dumps(case.config).replace("<ckpt>", os.path.join(out, "model.ckpt")).replace("<out>", out))
        env = job_environment()
        holder = None
        if case.port_holder is not None:
            holder = socket.socket()  # the kernel's pick: a port freed a moment ago may still be in TIME_WAIT
            holder.bind(("127.0.0.1", 0))
            env["MASTER_PORT"] = str(holder.getsockname()[1])
            if case.port_holder == "listening":
                holder.listen()
        if case.lone_rank is not None:
            env.update(WORLD_SIZE=str(config["devices"]), NODE_RANK="0", LOCAL_RANK=str(case.lone_rank),
                       RANK=str(case.lone_rank))
        given, given_bytes = os.path.join(out, "given.ckpt"), None
        if case.damaged is not None:  # write the checkpoint the job resumes from, then damage it
            writer = json.loads(json.dumps(case.damaged[0]).replace("<out>", out))
            subprocess.run([sys.executable, SCRIPT, json.dumps(writer), out], capture_output=True, env=job_environment(),
                           timeout=limit, check=True)
            if case.damaged[1] == "truncate":
                with open(given, "rb") as f:
                    data = f.read()
                with open(given, "wb") as f:
                    f.write(data[: len(data) // 2])
            with open(given, "rb") as f:
                given_bytes = f.read()
        started = time.time()
        proc = subprocess.Popen([sys.executable, SCRIPT, json.dumps(config), out], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=limit)
            code: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            code = "hung"
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        ended = time.time()
        if holder is not None:
            holder.close()
        deadline = time.time() + 15  # the reaper's grace, then look
        while _job_processes(proc.pid) and time.time() < deadline:
            time.sleep(0.2)
        gone = time.time()
        orphans = _job_processes(proc.pid)
        for pid in orphans:
            os.kill(pid, signal.SIGKILL)
        injected = re.search(r"injecting \w+ on rank \d at step -?\d+ at ([\d.]+)", output)
        fault_at = float(injected.group(1)) if injected else None
        seconds = (gone if orphans or gone > ended + 0.3 else ended) - (fault_at or started) if code != "hung" else None
        named = None
        if case.says is not None:
            named = case.says in output
        elif case.failed_rank is not None:
            survivors = [line for line in output.splitlines()
                         if ("PeerFailure" in line or "PipelineTimeout" in line) and not line.startswith(("  ", "[rank"))
                         or ("lightning_pipe." in line and ("PeerFailure" in line or "PipelineTimeout" in line))]
            named = any(f"rank {case.failed_rank}" in line for line in survivors)
        checkpoint_ok = None
        if case.checkpoint:
            if config.get("kill_in_save"):  # the killed save left its temporary file; the next job saves there
                rerun = {**config, "kill_in_save": False}
                subprocess.run([sys.executable, SCRIPT, json.dumps(rerun), out], capture_output=True, env=job_environment(),
                               timeout=limit)
            if case.written is not None:
                found = sorted(glob.glob(os.path.join(out, case.written)))
                checkpoint_ok = bool(found) and _loads(found[-1])
            else:
                path = os.path.join(out, "model.ckpt")
                checkpoint_ok = os.path.exists(path) and not any(".partial-" in f for f in os.listdir(out))
        if given_bytes is not None:  # the failed resume left the file it was given as it was
            with open(given, "rb") as f:
                checkpoint_ok = f.read() == given_bytes
        errors = re.findall(r"^(?:\[rank\d\]: )?lightning_pipe\.errors\.(\w+: .*)$", output, re.MULTILINE)
        return Outcome(code, seconds, named, orphans, checkpoint_ok, errors[-1] if errors else None, output)
