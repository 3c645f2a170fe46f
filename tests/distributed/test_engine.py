"""The executor without Lightning: every synchronous schedule equals one-device training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.engine import Executor, RunOptions, SequentialStage, Transport, Watchdog, split_micro_batches
from lightning_pipe.engine.p2p import ChannelGroups
from lightning_pipe.partition import resolve_balance, stage_bounds
from lightning_pipe.registry import build_schedule
from tests.harness.distributed import run_workers, values


class PairUp(nn.Module):
    """Returns a tuple (float activation, integer tensor) to exercise tuple messages and int passthrough."""

    def forward(self, x):
        return x, (x.sum(dim=1) > 0).long()


class UsePair(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, pair):
        x, flag = pair
        return torch.tanh(self.linear(x)) + flag.unsqueeze(1).to(x.dtype) * 0.1


def make_trunk(seed: int = 0, width: int = 8, depth: int = 8) -> nn.Sequential:
    """Linear/Tanh pairs with one (activation, int flag) tuple crossing a layer boundary."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        layers.append(nn.Tanh())
    layers[5] = PairUp()  # outputs a tuple; layer 6 consumes it
    layers[6] = UsePair(width)
    return nn.Sequential(*layers)


def make_batch(n: int = 12, width: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)


def loss_fn(output, micro_batch):
    return nn.functional.mse_loss(output, micro_batch[1])


def reference(steps: int, batches: list, lr: float = 0.1):
    trunk = make_trunk()
    opt = torch.optim.SGD(trunk.parameters(), lr=lr, momentum=0.9)
    losses = []
    for x, y in batches[:steps]:
        opt.zero_grad()
        loss = loss_fn(trunk(x), (x, y))
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return losses, {k: v.clone() for k, v in trunk.state_dict().items()}


def make_transport(wire: str) -> Transport:
    """``"gloo"``: the process group as is; ``"nccl"``: the transport NCCL gets (no tags, one process group per
    channel), on gloo; ``"shm"``: shared memory between the processes (collective)."""
    if wire == "shm":
        import torch.distributed as dist

        from lightning_pipe.engine.shm import SharedMemoryTransport

        transport = SharedMemoryTransport.create(torch.device("cpu"))
        assert set(transport.peers) == set(range(dist.get_world_size())) - {dist.get_rank()}  # no message takes gloo
        return transport
    nccl_rules = wire == "nccl"
    return Transport(torch.device("cpu"), tagged=not nccl_rules, channels=ChannelGroups.create() if nccl_rules else None)


def pipeline_worker(rank: int, world: int, name: str, micro_batches: int, chunks: int, batches: list, wire: str = "gloo",
                    background_w: bool = False):
    """One pipeline of ``world`` devices over ``wire`` (:func:`make_transport`); returns losses (last
    device) and local weights. ``background_w``: zero-bubble ``W`` on the background worker, as on CUDA."""
    from lightning_pipe.engine import weight_worker

    weight_worker.ON_CPU = background_w  # this pooled process serves other tests next: put back below
    try:
        return _pipeline(rank, world, name, micro_batches, chunks, batches, wire)
    finally:
        weight_worker.ON_CPU = False


def _pipeline(rank: int, world: int, name: str, micro_batches: int, chunks: int, batches: list, wire: str):
    trunk = make_trunk()
    parts = world * chunks
    bounds = stage_bounds(resolve_balance("uniform", trunk, parts))
    schedule = build_schedule(name, world, micro_batches, chunks)
    stages, params = [], []
    for chunk in range(chunks):
        vs = schedule.virtual_stage(rank, chunk)  # zbv places its chunks as a V
        start, end = bounds[vs]
        layers = trunk[start:end]
        params += list(layers.parameters())
        stages.append(SequentialStage(
            layers,
            input_fn=(lambda mb: mb[0]) if vs == 0 else None,
            loss_fn=loss_fn if vs == parts - 1 else None,
        ))
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    transport = make_transport(wire)
    executor = Executor(rank, list(range(world)), stages, transport, Watchdog.from_process_group(60.0))
    losses = []
    for batch in batches:
        mbs = split_micro_batches(batch, micro_batches)
        weights = [len(mb[0]) / len(batch[0]) for mb in mbs]
        out = executor.run(schedule, mbs, RunOptions(loss_weights=weights, step=lambda: (opt.step(), opt.zero_grad())))
        if out:
            losses.append(sum(w * l.item() for w, l in zip(weights, out)))
    owned = {}
    for chunk in range(chunks):
        start, end = bounds[schedule.virtual_stage(rank, chunk)]
        owned.update({f"{i}.{k}": v for i in range(start, end) for k, v in trunk[i].state_dict().items()})
    return losses, owned


@pytest.mark.parametrize(
    "name,world,micro_batches,chunks,wire",
    [("gpipe", 2, 4, 1, "gloo"), ("1f1b", 2, 3, 1, "gloo"), ("interleaved_1f1b", 2, 4, 2, "gloo"), ("1f1b", 4, 6, 1, "gloo"),
     ("interleaved_1f1b", 4, 4, 2, "gloo"), ("interleaved_1f1b", 2, 4, 2, "nccl"), ("1f1b", 4, 6, 1, "nccl"),
     # 12 samples in 5 micro-batches (3, 3, 2, 2, 2): a shape header again mid-step, on every transport
     ("1f1b", 2, 5, 1, "gloo"), ("gpipe", 3, 5, 1, "nccl"), ("1f1b", 2, 5, 1, "shm"),
     ("interleaved_1f1b", 4, 4, 2, "shm"),
     # zero-bubble: split backward; zbv's V hands over in memory on device 1 and needs a group per channel on NCCL
     ("zb_h1", 2, 5, 1, "gloo"), ("zbv", 2, 4, 2, "nccl"), ("zbv", 2, 2, 2, "gloo"), ("zbv", 2, 4, 2, "shm"),
     ("dualpipev", 2, 5, 2, "nccl")],
)
def test_pipeline_equals_single_device(name, world, micro_batches, chunks, wire):
    batches = [make_batch(seed=s) for s in range(3)]
    ref_losses, ref_state = reference(3, batches)
    results = values(run_workers(pipeline_worker, world, name, micro_batches, chunks, batches, wire, timeout=120))
    losses = [r[0] for r in results if r[0]]
    assert len(losses) == 1
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
    merged = {}
    for _, owned in results:
        merged.update(owned)
    assert merged.keys() == ref_state.keys()
    for key, value in ref_state.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,micro_batches,wire", [("zbv", 4, "nccl"), ("dualpipev", 5, "gloo")])
def test_background_w_on_processes_computes_the_main_threads_bits(name, micro_batches, wire):
    """Each rank's W on its background worker (engine/weight_worker.py, forced on here as on CUDA) while its main
    thread sends and receives: the same losses and weights, bit for bit, as every W on the main thread."""
    batches = [make_batch(seed=s) for s in range(3)]
    runs = [values(run_workers(pipeline_worker, 2, name, micro_batches, 2, batches, wire, background, timeout=120))
            for background in (True, False)]
    for (losses, owned), (want_losses, want_owned) in zip(*runs):
        assert losses == want_losses
        assert owned.keys() == want_owned.keys() and all(torch.equal(owned[k], want_owned[k]) for k in owned)


def reducer_worker(rank: int, world: int):
    """Each rank's gradients of its own batch, averaged by GradientReducer while the backward runs
    (small buckets, so several launch during it) and by one flat all-reduce afterwards."""
    import torch.distributed as dist

    from lightning_pipe.engine.collectives import GradientReducer, all_reduce_flat

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3), nn.Linear(3, 3))
    model[5].requires_grad_(False)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(rank))
    params = [p for p in model.parameters() if p.requires_grad]
    reducer = GradientReducer(params, None, world, bucket_bytes=256)
    launched = []  # the all-reduces posted while the backward ran (this worker's torch.distributed, restored after)
    all_reduce = dist.all_reduce
    dist.all_reduce = lambda tensor, *args, **kwargs: launched.append(tensor.numel()) or all_reduce(tensor, *args, **kwargs)
    try:
        with reducer.armed():
            model(x).square().sum().backward()
    finally:
        dist.all_reduce = all_reduce
    filed_during_backward = len(launched)
    moved = [p.grad for p in params]  # the strategy moves gradients aside meanwhile (Lightning's zero_grad)
    for p in params:
        p.grad = None
    for p, g in zip(params, moved):
        p.grad = g
    reducer.finish()
    overlapped = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    model(x).square().sum().backward()
    all_reduce_flat([p.grad for p in params], None, scale=1.0 / world)
    return filed_during_backward, overlapped, [p.grad for p in params]


def test_gradient_reducer_averages_while_the_backward_runs():
    for filed, overlapped, flat in values(run_workers(reducer_worker, 2, timeout=60)):
        assert filed >= 2  # buckets launched before the backward ended
        for a, b in zip(overlapped, flat):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


class Routed(nn.Module):
    """A mixture of experts whose routing depends on the data: ``route`` names the experts a batch uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 8)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.out = nn.Linear(8, 2)

    def forward(self, x, route):
        h = torch.tanh(self.inp(x))
        return self.out(sum(self.experts[e](h) for e in route))


def unused_worker(rank: int, world: int, armed: bool):
    """Rank 0 routes through expert 0 only, rank 1 through experts 0 and 1; expert 2 is used by neither.
    Small buckets, so the unused experts sit in buckets of their own and in buckets shared with used ones."""
    from lightning_pipe.engine.collectives import GradientReducer

    model = Routed()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(rank))
    params = list(model.parameters())
    reducer = GradientReducer(params, None, world, bucket_bytes=200)
    route = [0] if rank == 0 else [0, 1]
    if armed:  # during the last backward (the overlapped path)
        with reducer.armed():
            model(x, route).square().sum().backward()
    else:  # afterwards (accumulation windows, the avgpipe policy)
        model(x, route).square().sum().backward()
    local = [None if p.grad is None else p.grad.clone() for p in params]
    reducer.finish()
    return local, [None if p.grad is None else p.grad.clone() for p in params]


@pytest.mark.parametrize("armed", [True, False])
def test_gradient_reducer_agrees_on_parameters_one_replica_did_not_use(armed):
    """Every replica reduces the same buckets, so the all-reduces match; a parameter one replica used
    averages with zeros for the other, one no replica used keeps no gradient (hazard 8 of issue 30)."""
    (local0, got0), (local1, got1) = values(run_workers(unused_worker, 2, armed, timeout=60))
    names = [n for n, _ in Routed().named_parameters()]
    for name, a, b, mine, theirs in zip(names, local0, local1, got0, got1):
        if name.startswith("experts.2"):
            assert mine is None and theirs is None, name
            continue
        want = ((a if a is not None else 0) + (b if b is not None else 0)) / 2
        torch.testing.assert_close(mine, want, rtol=1e-6, atol=1e-7, msg=name)
        torch.testing.assert_close(theirs, want, rtol=1e-6, atol=1e-7, msg=name)
    assert local0[names.index("experts.1.weight")] is None  # the case: rank 0 did not use expert 1
