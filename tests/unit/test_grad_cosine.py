"""grad_cosine (docs/metrics.md): the cosine between the stale gradient a stage took for one micro-batch and
the gradient at the weights its STEP updates, stage-local, without any effect on training."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_pipe.engine.grad_cosine import cosine
from lightning_pipe.engine.local import LocalPipeline
from lightning_pipe.engine.policies import AsyncOptions
from lightning_pipe.engine.policies.base import WeightPolicy
from lightning_pipe.registry import spec
from tests.harness.lightning_run import train


def test_cosine_of_per_parameter_gradients():
    a, b = [torch.tensor([1.0, 0.0]), None], [torch.tensor([1.0, 0.0]), torch.tensor([1.0])]
    assert float(cosine(a, b)) == pytest.approx(1 / 2 ** 0.5)
    assert float(cosine(a, a)) == pytest.approx(1.0)
    assert cosine([None], [None]) is None


STALE = ["pipedream", "pipedream_2bw", "pipemare", "xpipe"]


def _pipeline(name: str, dropout: float = 0.0, stages: int = 2, micro_batches: int = 2):
    """A 2-stage in-process pipeline of Linear-Tanh stages under ``name``'s weight policy, Adam at a large rate."""
    from lightning_pipe.engine import SequentialStage
    from lightning_pipe.engine.emulated import EmulatedAsyncSegments

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Dropout(dropout), nn.Tanh()) for _ in range(stages)])
    pipeline = LocalPipeline(stages)
    pipeline.chunks = [
        SequentialStage(model[s], input_fn=(lambda mb: mb[0]) if s == 0 else None,
                        loss_fn=(lambda out, mb: nn.functional.mse_loss(out, mb[1])) if s == stages - 1 else None)
        for s in range(stages)
    ]
    segments = EmulatedAsyncSegments(name, spec(name).policy, pipeline, stages, micro_batches)
    owned = [{n for n, _ in model.named_parameters() if n.startswith(f"{s}.")} for s in range(stages)]
    segments.start_stages(model, torch.optim.Adam(model.parameters(), lr=0.1), AsyncOptions(), None, None, 0, owned)
    return model, segments


def _windows(segments, count: int, micro_batches: int = 2, measure_at: int | None = None, before=None) -> None:
    generator = torch.Generator().manual_seed(1)
    for w in range(count):
        if w == measure_at and before is not None:
            before()
        for policy in segments.policies:
            policy.request_cosine(w == measure_at)
        batches = [(torch.randn(3, 4, generator=generator), torch.randn(3, 4, generator=generator)) for _ in range(micro_batches)]
        segments.run_window(batches, [1 / micro_batches] * micro_batches)
    segments.drain()


def _flat_cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    a, b = torch.cat([t.reshape(-1) for t in a]).double(), torch.cat([t.reshape(-1) for t in b]).double()
    return float(a @ b / (a.norm() * b.norm()))


@pytest.mark.parametrize("name", STALE)
def test_stage0_values_are_the_literal_cosine_and_descent_ratio(name, monkeypatch):
    """Stage 0's grad_cosine equals the cosine, computed here by hand, between the gradient of its forward at the
    weights that forward ran at and the gradient at the weights its STEP updates (the live policies' masters), for
    the same input and output gradient; its descent_ratio equals <g_f, U(g_s)> / <g_f, U(g_f)> with each update U
    made here by a second Adam loaded with the first one's state at that moment."""
    model, segments = _pipeline(name)
    policy, stage = segments.policies[0], model[0]
    monkeypatch.setattr(WeightPolicy, "measure_descent", True)
    calls: list[tuple[torch.Tensor, ...]] = []
    seen: dict[str, object] = {}

    def forward_hook(module, args, output):
        calls.append((args[0].detach().clone(), module[0].weight.detach().clone(), module[0].bias.detach().clone()))
        if len(calls) - 1 == seen.get("index"):
            output.register_hook(lambda grad: seen.setdefault("dy", grad.detach().clone()))

    def record(value):  # right after the recompute: the weights the coming STEP updates
        seen["applied"] = [t.detach().clone() for t in policy.applied_tensors()]
        seen["optimizer"] = copy.deepcopy(policy.optimizer.state_dict())
        seen["stepped"] = [p.detach().clone() for group in policy.optimizer.param_groups for p in group["params"]]
        type(policy).record_cosine(policy, value)

    policy.record_cosine = record
    stage.register_forward_hook(forward_hook)
    _windows(segments, 6, measure_at=3, before=lambda: seen.setdefault("index", len(calls)))
    x, weight, bias = calls[seen["index"]]
    names = list(policy.params)
    applied = dict(zip(names, seen["applied"]))

    def gradient(w: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
        w, b = w.clone().requires_grad_(), b.clone().requires_grad_()
        return list(torch.autograd.grad(torch.tanh(x @ w.T + b), [w, b], seen["dy"]))

    stale, fresh = gradient(weight, bias), gradient(applied["0.0.weight"], applied["0.0.bias"])
    expected = _flat_cosine(stale, fresh)
    assert expected < 1 - 1e-6  # stale enough to matter
    assert float(policy.grad_cosine) == pytest.approx(expected, abs=1e-6)

    def update(g: list[torch.Tensor]) -> list[torch.Tensor]:  # Adam's step from the recorded state, on copies
        copies = [t.clone().requires_grad_() for t in seen["stepped"]]
        reference = torch.optim.Adam(copies, lr=0.1)
        reference.load_state_dict(copy.deepcopy(seen["optimizer"]))  # a step changes the loaded tensors in place
        copies[0].grad, copies[1].grad = 2 * g[0], 2 * g[1]  # stage 0's weight and bias; M = 2 micro-batches a step
        reference.step()
        return [(c - t).detach() for c, t in zip(copies[:2], seen["stepped"][:2])]

    def first_order(u: list[torch.Tensor]) -> float:
        return float(sum((f.double() * x.double()).sum() for f, x in zip(fresh, u)))

    ratio = first_order(update(stale)) / first_order(update(fresh))
    assert float(policy.descent_ratio) == pytest.approx(ratio, rel=1e-5)
    assert abs(ratio - 1) > 1e-3  # the staleness changed the update
    if name == "pipedream":  # the last stage's forward and backward see the weights its STEP updates
        assert float(segments.policies[1].grad_cosine) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("name", STALE)
def test_measuring_leaves_training_bit_identical(name, monkeypatch):
    """With dropout (the recompute replays the forward's RNG state in a forked stream): the same weights and the
    same RNG stream after a run that measures in every window as after one that never does."""
    weights, streams = [], []
    for measure in (None, "all"):
        model, segments = _pipeline(name, dropout=0.3)
        monkeypatch.setattr(WeightPolicy, "measure_descent", True)  # its trial steps too
        generator = torch.Generator().manual_seed(1)
        for w in range(6):
            for policy in segments.policies:
                policy.request_cosine(measure is not None)
            batches = [(torch.randn(3, 4, generator=generator), torch.randn(3, 4, generator=generator)) for _ in range(2)]
            segments.run_window(batches, [0.5, 0.5])
        segments.drain()
        assert all((p.grad_cosine is not None) == (measure is not None) for p in segments.policies)
        assert all((p.descent_ratio is not None) == (measure is not None) for p in segments.policies)
        weights.append([p.detach().clone() for p in model.parameters()])
        streams.append(torch.get_rng_state())
    assert all(torch.equal(a, b) for a, b in zip(*weights))
    assert torch.equal(*streams)


def test_descent_ratio_is_measured_only_when_switched_on():
    model, segments = _pipeline("pipedream")
    _windows(segments, 4, measure_at=2)
    assert segments.policies[0].grad_cosine is not None and segments.policies[0].descent_ratio is None


@pytest.mark.parametrize("schedule", ["pipedream", "pipemare"])
def test_logged_under_an_emulated_stale_schedule(schedule):
    record = train({"devices": 1, "max_steps": 4, "batch_size": 16, "model": {"optimizer": "sgd"},
                    "trainer": {"log_every_n_steps": 2},
                    "strategy": {"schedule": schedule, "stages": 2, "micro_batches": 4, "grad_cosine_every": 2}})
    last = record["metrics"][-1]
    assert -1 <= last["pipe/stage0/grad_cosine"] <= 1 + 1e-6
    assert 0.5 < last["pipe/stage0/grad_cosine"]  # a small learning rate barely turns the gradient
    assert last["pipe/stage1/grad_cosine"] == pytest.approx(1.0, abs=1e-5)  # its backward follows its forward


def test_off_by_default_and_not_logged():
    record = train({"devices": 1, "max_steps": 2, "batch_size": 16, "trainer": {"log_every_n_steps": 1},
                    "strategy": {"schedule": "pipedream", "stages": 2, "micro_batches": 4}})
    assert not any(key.endswith("/grad_cosine") for key in record["metrics"][-1])


def test_lightning_run_with_grad_cosine_every_step_trains_the_same_weights():
    runs = [train({"devices": 1, "max_steps": 4, "batch_size": 16, "trainer": {"log_every_n_steps": 2},
                   "strategy": {"schedule": "xpipe", "stages": 2, "micro_batches": 4, "grad_cosine_every": every}})
            for every in (0, 1)]
    assert runs[0]["state"].keys() == runs[1]["state"].keys()
    assert all(torch.equal(runs[0]["state"][k], runs[1]["state"][k]) for k in runs[0]["state"])


def test_grad_cosine_every_is_checked():
    from lightning_pipe import PipeStrategy
    from lightning_pipe.errors import PipeConfigError

    with pytest.raises(PipeConfigError, match="grad_cosine_every=-1 must be a whole number"):
        PipeStrategy(schedule="pipedream", grad_cosine_every=-1)
    with pytest.raises(PipeConfigError, match="grad_cosine_every=5 measures how stale gradients turn"):
        PipeStrategy(schedule="1f1b", grad_cosine_every=5)
    assert PipeStrategy(schedule="pipedream").options.grad_cosine_every == 0


@pytest.mark.parametrize("schedule", ["pipedream", "pipedream_2bw"])
def test_checkpointed_stages_train_the_same_weights(schedule):
    """With activation checkpointing the stale pass recomputes the stage's forward once more inside the retained
    graph; the regular backward still sees the same graph."""
    runs = [train({"devices": 1, "max_steps": 3, "batch_size": 16, "trainer": {"log_every_n_steps": 1},
                   "strategy": {"schedule": schedule, "stages": 2, "micro_batches": 4, "checkpoint_activations": True,
                                "grad_cosine_every": every}})
            for every in (0, 1)]
    assert all(torch.equal(runs[0]["state"][k], runs[1]["state"][k]) for k in runs[0]["state"])
    assert 0 < runs[1]["metrics"][-1]["pipe/stage0/grad_cosine"] <= 1 + 1e-6
