"""The avgpipe tuner on synthetic profiles: fits, memory check, simulated prediction, tie rules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.planning.avgpipe_autotune import Choice, describe
from lightning_pipe.planning.avgpipe_trials import fastest
from lightning_pipe.planning.avgpipe_tuner import Candidate, fit_line, fit_stages, predict, profile_step, tune
from lightning_pipe.planning.profile import LayerProfile, Profile
from lightning_pipe.schedules import MergeCosts, build_avgpipe
from lightning_pipe.sim.simulate import Costs, simulate


def profile(b: int, overhead: float = 1e-3) -> Profile:
    """4 layers, 2 per stage: forward = overhead + 1e-4 b per layer, backward twice that."""
    layers = tuple(LayerProfile("Linear", overhead + 1e-4 * b, 2 * (overhead + 1e-4 * b), 1000, 400 * b, 40 * b)
                   for _ in range(4))
    return Profile(b, "cpu", layers)


def test_fits_recover_the_lines():
    line = fit_line([(2, 5.0), (4, 9.0), (8, 17.0)])
    assert (line.c0, line.c1) == pytest.approx((1.0, 2.0))
    fits = fit_stages([profile(4), profile(16), profile(32)], [2, 2])
    assert fits[0].forward.c0 == pytest.approx(2e-3) and fits[0].forward.c1 == pytest.approx(2e-4)
    assert fits[1].backward(10) == pytest.approx(2 * (2e-3 + 2e-3))
    assert fits[0].activation_per_sample == 800 and fits[0].output_per_sample == 40 and fits[0].params == 2000


def test_prediction_is_the_simulated_merge():
    fits = fit_stages([profile(4), profile(16)], [2, 2])
    c = predict(fits, batch=64, replicas=2, micro_batches=4, advance=1)
    b = 64 // 2 // 4
    forward = tuple(f.forward(b) for f in fits)
    backward = tuple(f.backward(b) for f in fits)
    merged = build_avgpipe(2, 4, 2, 1, MergeCosts(forward, backward, (0.0,), 0.0))
    assert c.round_time == pytest.approx(simulate(merged, Costs(forward, backward, (0.0,))).step_time)
    assert c.throughput == pytest.approx(64 / c.round_time) and c.micro_batch_size == b
    # memory: N*(kappa+... ) static + center + N * min(M, w_s + a_s + 1) micro-batches of activations
    assert c.memory[0] == pytest.approx(2 * 4 * 2000 + 2000 + 2 * min(4, 1 + 1 + 1) * 800 * b)
    assert c.memory[1] == pytest.approx(2 * 4 * 2000 + 2000 + 2 * 1 * 800 * b)


def test_step_time_is_profiled_and_simulated():
    """STEP + AVG: measured on a copy (weights unchanged), positive; the slowest stage's time enters the simulation."""
    stage = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    before = [p.detach().clone() for p in stage.parameters()]
    t = profile_step(stage, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), repeats=3, warmup=1)
    assert t > 0 and all(torch.equal(a, b) for a, b in zip(before, stage.parameters()))
    assert profile_step(nn.ReLU(), lambda ps: torch.optim.SGD(ps, lr=0.1)) == 0.0
    fits = fit_stages([profile(4), profile(16)], [2, 2], steps=[1e-3, 3e-3])
    assert [f.step for f in fits] == [1e-3, 3e-3]
    with pytest.raises(ValueError, match="one STEP time per stage"):
        fit_stages([profile(4)], [2, 2], steps=[1e-3])
    c = predict(fits, batch=64, replicas=2, micro_batches=4)
    b = 64 // 2 // 4
    forward = tuple(f.forward(b) for f in fits)
    backward = tuple(f.backward(b) for f in fits)
    merged = build_avgpipe(2, 4, 2, 0, MergeCosts(forward, backward, (0.0,), 3e-3))
    assert c.round_time == pytest.approx(simulate(merged, Costs(forward, backward, (0.0,), 3e-3), 2).step_time)
    assert c.round_time > predict(fits, batch=64, replicas=2, micro_batches=4, step=0.0).round_time
    # with a costly STEP, fewer replicas (fewer STEPs per round) win
    assert tune(fits, batch=64, max_replicas=4)[0].replicas == 1


def test_tuner_picks_the_best_feasible_and_breaks_ties():
    fits = fit_stages([profile(4), profile(16)], [2, 2])
    ranked = tune(fits, batch=32, max_replicas=3, advances=(0, 1))
    assert all(isinstance(c, Candidate) for c in ranked) and {c.replicas for c in ranked} == {1, 2}  # 3 does not divide 32
    best = ranked[0]
    assert best.throughput == pytest.approx(max(c.throughput for c in ranked))
    # a memory cap below what two replicas need leaves only N=1
    cap = 17000 / 0.9  # two replicas' static bytes alone (2 * 4 * 2000 + 2000) exceed it
    capped = tune(fits, batch=32, max_replicas=2, memory=[cap, cap])
    assert {c.replicas for c in capped} == {1} and all(max(c.memory) <= 0.9 * cap for c in capped)
    with pytest.raises(ValueError, match="no avgpipe candidate fits"):
        tune(fits, batch=32, memory=[1.0, 1.0])
    # no per-micro-batch overhead and free communication: many candidates tie; smaller N then larger b win
    flat = fit_stages([Profile(b, "cpu", tuple(LayerProfile("L", 1e-4 * b, 2e-4 * b, 10, 1, 1) for _ in range(2)))
                       for b in (4, 8)], [1, 1])
    ranked = tune(flat, batch=16, max_replicas=2, micro_batch_choices=(1,), tie=1e-3)
    top = ranked[0]
    assert top.replicas == 1 or ranked[0].throughput > ranked[1].throughput * (1 + 1e-3)


def _candidate(replicas: int, micro_batches: int, advance: int = 0, batch: int = 8) -> Candidate:
    b = batch // replicas // micro_batches
    return Candidate(replicas, micro_batches, advance, b, 1.0, batch / 1.0, (0.0, 0.0), True)






def test_fastest_measured_wins_and_the_table_shows_both():
    cands = [_candidate(1, 2), _candidate(1, 4), _candidate(2, 1)]
    measured = fastest(cands, [[3.0, 2.0, 9.0], [2.0, 2.0, 1.0], [2.0, 2.0, 3.0]], batch=8)
    assert [m.candidate for m in measured] == [cands[1], cands[2], cands[0]]  # medians 2, 2 (tie: predicted order), 3
    assert measured[0].round_time == 2.0 and measured[0].throughput == 4.0
    text = describe(Choice(measured[0].candidate, cands, measured))
    assert "measured samples/s" in text and text.splitlines()[3].endswith("<- chosen")


def _fit(strategy, ckpt_path=None, steps=3):
    import lightning as L
    from torch.utils.data import DataLoader

    from tests.harness.lightning_run import Recorder, TrunkModel, make_data

    recorder = Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[recorder])
    trainer.fit(TrunkModel(), DataLoader(make_data(64), batch_size=16), ckpt_path=ckpt_path)
    return trainer, [m["train_loss"] for m in recorder.metrics]


def test_auto_trains_exactly_like_the_chosen_values_given_by_hand(tmp_path, monkeypatch):
    """All three avgpipe options "auto" (one process, one stage): profiling, prediction and trials
    leave no trace, so training equals the chosen values given by hand; a checkpoint stores them and
    a resumed "auto" run adopts them without tuning again."""
    from lightning_pipe import PipeStrategy
    from lightning_pipe.lightning import auto as lightning_auto
    from lightning_pipe.lightning.runtimes import AVGPIPE_STATE_KEY
    from lightning_pipe.planning import avgpipe_autotune as avg_autotune

    auto = PipeStrategy(schedule="avgpipe", micro_batches="auto", avgpipe={"parallel_pipelines": "auto", "advance_forward": "auto"})
    trainer, losses = _fit(auto)
    n, m, a = auto.options.avgpipe.parallel_pipelines, auto.micro_batches, auto.options.avgpipe.advance_forward
    assert 1 <= n <= 4 and 16 % n == 0 and (16 // n) % m == 0 and a in avg_autotune.ADVANCES, (n, m, a)
    assert trainer.global_step == 3
    _, by_hand = _fit(PipeStrategy(schedule="avgpipe", micro_batches=m, avgpipe={"parallel_pipelines": n, "advance_forward": a}))
    assert losses == by_hand

    path = str(tmp_path / "auto.ckpt")
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    assert saved[avg_autotune.CHECKPOINT_KEY] == {"parallel_pipelines": n, "micro_batches": m, "advance_forward": a}
    assert len(saved[AVGPIPE_STATE_KEY]["weights"]) == n  # the run trained n replicas, not only recorded n
    monkeypatch.setattr(lightning_auto, "predict_candidates", lambda *args, **kwargs: pytest.fail("tuned again"))
    resumed = PipeStrategy(schedule="avgpipe", micro_batches="auto", avgpipe={"parallel_pipelines": "auto", "advance_forward": "auto"})
    trainer, _ = _fit(resumed, ckpt_path=path, steps=4)
    assert (resumed.options.avgpipe.parallel_pipelines, resumed.micro_batches, resumed.options.avgpipe.advance_forward) == (n, m, a)
    assert trainer.global_step == 4


def test_the_users_optimizer_class_is_rebuilt_from_its_defaults():
    """Trials and the STEP profile rebuild the user's optimizer from its class and defaults; torch's
    AdamW keeps a ``decoupled_weight_decay`` default its constructor refuses."""
    from lightning_pipe.planning.avgpipe_autotune import optimizer_factory, optimizer_spec

    layer = nn.Linear(4, 4)
    for optimizer in (torch.optim.AdamW(layer.parameters(), lr=3e-3, weight_decay=0.1),
                      torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9, nesterov=True)):
        spec = optimizer_spec(optimizer)
        rebuilt = optimizer_factory(spec)(nn.Linear(4, 4).parameters())
        assert type(rebuilt) is type(optimizer)
        assert {k: rebuilt.defaults[k] for k in spec[1]} == spec[1]
        assert rebuilt.defaults["lr"] == optimizer.defaults["lr"]
