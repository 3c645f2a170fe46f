"""The GPU path's rules, checked on the CPU with fakes (issue 30): which wait a transport's requests get,
when a header goes through pinned memory."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from lightning_pipe.engine.executor import Executor
from lightning_pipe.engine.p2p import Transport
from lightning_pipe.engine.watchdog import Watchdog, stream_ordered
from lightning_pipe.registry import build_schedule


class FakeWork:
    """A request that records how it was waited for."""

    def __init__(self) -> None:
        self.waits: list[tuple] = []

    def wait(self, *timeout) -> bool:
        self.waits.append(timeout)
        return True


@pytest.mark.parametrize("device,tagged,expected", [("cuda", False, True), ("cpu", True, False),
                                                    ("cpu", False, False), ("cuda", True, False)])
def test_only_nccl_waits_on_the_stream(device, tagged, expected):
    """NCCL (untagged, CUDA tensors) waits on the stream; gloo (tagged) and CPU tensors wait on the host."""
    assert stream_ordered(torch.device(device), tagged) is expected
    assert Transport(torch.device(device), tagged=tagged).stream_ordered is expected


def test_a_stream_ordered_wait_has_no_host_timeout_and_a_host_wait_is_bounded():
    watchdog = Watchdog(timeout=7.0)
    nccl, gloo = FakeWork(), FakeWork()
    watchdog.wait(nccl, "an activation", stream_ordered=True)
    watchdog.wait(gloo, "an activation")
    assert nccl.waits == [()]  # NCCL: the current stream waits, the host goes on
    assert gloo.waits == [(timedelta(seconds=7.0),)]


class SendsFakeWork(Transport):
    """A transport whose activation sends are posted as ``work`` (nothing leaves the process)."""

    def __init__(self, device: str, tagged: bool, work: FakeWork) -> None:
        super().__init__(torch.device(device), tagged=tagged)
        self.work = work

    def send_activation(self, value, dst, lane=0, header=True, micro_batch=-1):
        return [(self.work, value)]


def test_the_executor_waits_as_its_transport_says():
    """Through the executor's public run: stage 0 of two forwards and sends micro-batch 0, and the end of
    the run waits for that send, on the stream over NCCL, on the host with the watchdog's timeout over gloo."""
    schedule = build_schedule("gpipe", 2, 1, forward_only=True)
    work = FakeWork()
    timeouts = []
    for device, tagged in (("cuda", False), ("cpu", True)):
        executor = Executor(0, [0, 1], [lambda inputs, micro_batch: micro_batch * 2], transport=SendsFakeWork(device, tagged, work))
        executor.run(schedule, [torch.zeros(2)])
        timeouts.append(executor.watchdog.timeout)
    assert work.waits == [(), (timedelta(seconds=timeouts[1]),)]


class CopyLog:
    """Stands in for a tensor's ``pin_memory`` and ``to``: records the calls, copies nothing."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple] = []
        log = self

        def pin_memory(tensor, *args):
            log.calls.append(("pin_memory",))
            return tensor

        def to(tensor, device, non_blocking=False, **kwargs):
            log.calls.append(("to", torch.device(device).type, non_blocking))
            return tensor

        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
        monkeypatch.setattr(torch.Tensor, "to", to)


@pytest.mark.parametrize("device,expected", [
    ("cuda", [("pin_memory",), ("to", "cuda", True)]),  # pinned, then queued on the stream
    ("cpu", [("to", "cpu", False)]),  # nothing to stage (and pinning needs CUDA)
])
def test_a_header_goes_to_a_cuda_device_through_pinned_memory(monkeypatch, device, expected):
    from lightning_pipe.engine.p2p import Header, host_to_device

    log = CopyLog(monkeypatch)
    host_to_device(torch.zeros(4, dtype=torch.int64), torch.device(device))
    assert log.calls == expected
    log.calls.clear()
    Header.of(torch.zeros(2, 3)).encode(torch.device(device))
    assert log.calls == expected


def test_the_emulation_keeps_its_headers_in_host_memory():
    """One process decodes the header it sent: a device copy would only add a host synchronisation."""
    from lightning_pipe.engine.local import LocalTransport

    queues, sent = {}, {}
    LocalTransport(0, queues, sent).send_activation(torch.zeros(2, 3), dst=1)
    _, header = LocalTransport(1, queues, sent).post_header(0)
    assert header.device.type == "cpu"


def test_the_gpu_tests_import_neither_jsonargparse_nor_hypothesis():
    """The GPU machine's Python has neither (issue 30): the GPU tests, tests/conftest.py and the harness they
    import must not need them."""
    import pathlib
    import subprocess
    import sys

    code = ("import sys, builtins\n"
            "real = builtins.__import__\n"
            "def guard(name, *a, **k):\n"
            "    if name.split('.')[0] in ('jsonargparse', 'hypothesis'):\n"
            "        raise ImportError('no ' + name + ' on the GPU machine')\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = guard\n"
            "import tests.conftest, tests.gpu.test_one_gpu, tests.harness.pool\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=pathlib.Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("fused", [False, True])
def test_a_scaler_skips_the_step_another_rank_overflowed(monkeypatch, fused):
    """This rank's gradients are finite; the all-reduced flag says another stage overflowed: the step is
    skipped and the scale halves, also with a fused optimizer (which unscales inside its own step)."""
    from lightning_pipe.lightning import loss_scaling

    reduced = []

    def all_reduce(flag, op=None, group=None):  # the other rank's flag was 1
        reduced.append(float(flag))
        flag.fill_(1.0)

    monkeypatch.setattr(loss_scaling.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(loss_scaling.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(loss_scaling.dist, "all_reduce", all_reduce)
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.Adam([weight], lr=0.1, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    loss_scaling.agree_on_overflow(scaler)
    loss_scaling.agree_on_overflow(scaler)  # idempotent: one wrap
    scaler.scale((weight * 2).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert reduced == [0.0]  # this rank's own flag, reduced once
    assert torch.equal(weight.detach(), torch.ones(3))  # skipped
    assert scaler.get_scale() == 2.0


def test_fp16_loss_scaling_is_refused_where_the_optimizer_steps_inside_the_pipeline():
    from lightning_pipe.errors import PipeConfigError
    from lightning_pipe.lightning.loss_scaling import check_loss_scaling

    check_loss_scaling("1f1b", False, torch.amp.GradScaler("cpu"))
    check_loss_scaling("pipemare", True, None)  # bf16 or 32: nothing to agree on
    with pytest.raises(PipeConfigError, match="precision='bf16-mixed'"):
        check_loss_scaling("pipemare", True, torch.amp.GradScaler("cpu"))


@pytest.mark.parametrize("stages,pipelines", [(2, 1), (4, 1), (3, 2)])
def test_channel_groups_are_two_rank_groups_made_in_one_order_on_every_rank(monkeypatch, stages, pipelines):
    """Every rank calls ``dist.new_group`` with the same rank lists in the same order (torch's rule), and keeps
    the four channels (two directions, two kinds) of each neighbour: a group per pair and channel (hazard 5)."""
    from lightning_pipe.engine import p2p

    world = stages * pipelines
    calls: dict[int, list[list[int]]] = {}
    for rank in range(world):
        made = calls.setdefault(rank, [])
        monkeypatch.setattr(p2p.dist, "get_rank", lambda rank=rank: rank)
        monkeypatch.setattr(p2p.dist, "get_world_size", lambda: world)
        monkeypatch.setattr(p2p.dist, "new_group", lambda ranks, timeout=None, made=made: made.append(ranks) or tuple(ranks))
        channels = p2p.ChannelGroups.create(None, stages, pipelines)
        first = rank - rank % stages
        neighbours = {first + (rank % stages + d) % stages for d in (-1, 1)} - {rank}
        assert {(src, dst) for src, dst, _ in channels.groups} == (
            {(rank, n) for n in neighbours} | {(n, rank) for n in neighbours})
        for (src, dst, kind), group in channels.groups.items():
            assert sorted(group) == sorted((src, dst)) and channels.pick(src, dst, kind == "gradient") is group
        far = [r for r in range(world) if r != rank and r not in neighbours]
        if far:
            with pytest.raises(ValueError, match="ring neighbours"):
                channels.pick(rank, far[0], False)
    assert all(made == calls[0] for made in calls.values())
    assert len(set(map(tuple, calls[0]))) == len(calls[0]) / 4  # four channels per pair
