"""The single-process reference of the asynchronous schedules (lightning_pipe/emulation.py).

Expected values come from the formulas of docs/async-semantics.md, written out here by hand
(scalar traces) or from plain mini-batch training; nothing here calls the emulator's helpers to
produce an expected value except where a test is about that helper.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.optim._muon import _zeropower_via_newtonschulz

from lightning_pipe.engine.policies import AsyncOptions, DoubleBufferOptions, PipeMareOptions
from tests.harness.lightning_run import muon_with_adam
from tests.reference.async_reference import AsyncEmulator, pipemare_lr_factor, round_half_up, xpipe_distances

SCHEDULES = ("pipedream", "pipedream_2bw", "pipemare", "xpipe")


# ----------------------------------------------------------------------------------- helpers


def mlp_stages(P: int, width: int = 4, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    stages: list[nn.Module] = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(P - 1)]
    stages.append(nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1)))
    return stages


def micro_batch_stream(n: int, width: int = 4, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, width, generator=gen), torch.randn(3, 1, generator=gen)) for _ in range(n)]


def input_fn(mb):
    return mb[0]


def mse(out, mb):
    return ((out - mb[1]) ** 2).mean()


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "muon":
        return muon_with_adam(params)
    if kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.Adam(params, lr=0.01)


def emulator(schedule, stages, opt_kind, M, **kwargs) -> AsyncEmulator:
    optimizers = [make_optimizer(opt_kind, s.parameters()) for s in stages]
    return AsyncEmulator(schedule, stages, optimizers, M, input_fn, mse, **kwargs)


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def valid_shapes(schedule: str):
    for P in (2, 3, 4):
        for M in (1, 2, 4):
            if schedule == "pipedream_2bw" and M < P:
                continue
            yield P, M


# --------------------------------------------------------------- 1. P = 1 is plain training


PLAIN_FOR_ONE_STAGE = [("pipedream", 1), ("pipedream", 3), ("pipemare", 1), ("pipemare", 3), ("xpipe", 1)]


@pytest.mark.parametrize("opt_kind", ["sgd_momentum", "adam"])
@pytest.mark.parametrize(("schedule", "M"), PLAIN_FOR_ONE_STAGE)
def test_single_stage_is_plain_minibatch_training(schedule, M, opt_kind):
    """P = 1: tau = 0 (pipemare's T1 factor is 1, T2 corrects by 0).

    Not plain for P = 1: 2bw (always one version behind, independent of P) and xpipe with M >= 2
    (s_f = s_b = 1); both are tested against what their formulas imply below.
    """
    segments = [3, 2]
    data = micro_batch_stream(sum(segments) * M)
    weights = [[(i + 1) / (M * (M + 1) / 2) for i in range(M)] for _ in range(sum(segments))]  # uneven shares

    (ref,) = mlp_stages(1)
    (emu_stage,) = mlp_stages(1)
    ref_opt = make_optimizer(opt_kind, ref.parameters())
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    emu_opt = make_optimizer(opt_kind, emu_stage.parameters())
    emu_sched = torch.optim.lr_scheduler.StepLR(emu_opt, step_size=2, gamma=0.5)
    emu = AsyncEmulator(
        schedule, [emu_stage], [emu_opt], M, input_fn, mse,
        options=AsyncOptions(PipeMareOptions(lr_reschedule=True, correction=True, lr_warmup_steps=3)),
        schedulers=[emu_sched], clip_val=0.5, clip_algorithm="norm",
    )

    t = 0
    for T in segments:
        for _ in range(T):
            mbs = data[t * M:(t + 1) * M]
            ref_losses = []
            for mb, w in zip(mbs, weights[t]):
                loss = mse(ref(input_fn(mb)), mb)
                ref_losses.append(loss.item())
                (loss * w).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            ref_sched.step()

            losses = emu.train_window(mbs, weights[t])
            assert losses == pytest.approx(ref_losses, abs=1e-6)
            torch.testing.assert_close(flat(emu_stage), flat(ref), atol=1e-6, rtol=0)
            t += 1
        emu.drain()
        torch.testing.assert_close(flat(emu_stage), flat(ref), atol=1e-6, rtol=0)
    assert emu.step_counts == [sum(segments)]
    assert emu_opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


def test_xpipe_distances_formula():
    # T = 1 reduces to SpecTrain: s_f = floor(k/2) + K - k - 1, s_b = floor(k/2)
    for K in range(1, 9):
        for k in range(K):
            assert xpipe_distances(k, K, 1) == (k // 2 + K - k - 1, k // 2)
    # P = 1: s_f = s_b = round_half_up((M - 1) / M), i.e. 0 for M = 1 and 1 for M >= 2
    assert xpipe_distances(0, 1, 1) == (0, 0)
    for M in range(2, 9):
        assert xpipe_distances(0, 1, M) == (1, 1)
    # ties round up: (4 + 2 - 2 - 1) / 2 = 1.5 -> 2 ; (2 - 1 + 0) / 2 = 0.5 -> 1
    assert xpipe_distances(1, 4, 2) == (2, 1)
    assert round_half_up(5, 2) == 3 and round_half_up(3, 2) == 2 and round_half_up(4, 3) == 1


@pytest.mark.parametrize("opt_kind", ["sgd_momentum", "adam", "sgd", "muon"])
def test_xpipe_single_stage_predicts_one_step_ahead(opt_kind):
    """P = 1, M = 3: s_f = s_b = 1, so each mini-batch's gradient is taken at Pred(W, 1) = W - lr * Delta.

    "muon" (Muon for the matrices, Adam for the biases, one combined optimizer): a matrix's Delta is
    the Newton-Schulz orthogonalisation of Muon's momentum buffer scaled by sqrt(max(1, rows/cols)),
    added to the fp32 weights in fp32 (not rounded to bf16 first), as Muon's own step adds it."""
    M, T = 3, 4
    data = micro_batch_stream(2 * T * M)
    (ref,) = mlp_stages(1)
    (emu_stage,) = mlp_stages(1)
    ref_opt = make_optimizer(opt_kind, ref.parameters())
    emu = AsyncEmulator("xpipe", [emu_stage], [make_optimizer(opt_kind, emu_stage.parameters())], M, input_fn, mse)
    last_grad: dict[str, torch.Tensor] = {}

    def delta(name: str, p: torch.Tensor) -> torch.Tensor:
        state = ref_opt.state.get(p, {})
        if opt_kind == "muon" and p.ndim == 2:
            if not state:
                return torch.zeros_like(p)
            ortho = _zeropower_via_newtonschulz(state["momentum_buffer"], (3.4445, -4.775, 2.0315), 5, 1e-7)
            return ortho.float() * math.sqrt(max(1.0, p.shape[0] / p.shape[1]))  # added in fp32, as Muon's step does
        if opt_kind in ("adam", "muon"):
            if not state:
                return torch.zeros_like(p)
            c = float(state["step"])
            m_hat = state["exp_avg"] / (1 - 0.9**c)
            v_hat = state["exp_avg_sq"] / (1 - 0.999**c)
            return m_hat / (v_hat.sqrt() + 1e-8)
        if opt_kind == "sgd_momentum":
            return state["momentum_buffer"] if state else torch.zeros_like(p)
        return last_grad.get(name, torch.zeros_like(p))

    for segment in range(2):
        for t in range(segment * T, (segment + 1) * T):
            mbs = data[t * M:(t + 1) * M]
            lr = {id(p): group["lr"] for group in ref_opt.param_groups for p in group["params"]}
            predicted = {n: (p.detach() - lr[id(p)] * 1 * delta(n, p)).requires_grad_() for n, p in ref.named_parameters()}
            ref_losses, grads = [], None
            for mb in mbs:
                loss = mse(functional_call(ref, predicted, (input_fn(mb),)), mb)
                ref_losses.append(loss.item())
                g = torch.autograd.grad(loss / M, list(predicted.values()))
                grads = g if grads is None else [a + b for a, b in zip(grads, g)]
            for (n, p), g in zip(ref.named_parameters(), grads):
                p.grad = g
                last_grad[n] = g.clone()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)

            losses = emu.train_window(mbs)
            assert losses == pytest.approx(ref_losses, abs=1e-6)
            torch.testing.assert_close(flat(emu_stage), flat(ref), atol=1e-6, rtol=0)
        emu.drain()
    assert emu.weight_copies == [3]


@pytest.mark.parametrize("opt_kind", ["sgd_momentum", "adam"])
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("lookahead", [0.0, 1.0, 0.5])
def test_2bw_single_stage_is_one_step_delayed(opt_kind, M, lookahead):
    """P = 1: mini-batch K's gradient is taken at V_{max(K-1, 0)} and applied to V_K, also across a
    drain; with look-ahead ``a`` at V_{K-1} + a (V_{K-1} - V_{K-2}) (V_{-1} = V_{-2} = V_0)."""
    segments = [3, 2]
    data = micro_batch_stream(sum(segments) * M)
    (ref,) = mlp_stages(1)
    (emu_stage,) = mlp_stages(1)
    ref_opt = make_optimizer(opt_kind, ref.parameters())
    emu_opt = make_optimizer(opt_kind, emu_stage.parameters())
    emu = AsyncEmulator("pipedream_2bw", [emu_stage], [emu_opt], M, input_fn, mse,
                        options=AsyncOptions(pipedream_2bw=DoubleBufferOptions(lookahead=lookahead)))
    previous = {n: p.detach().clone() for n, p in ref.named_parameters()}  # V_{K-1}, V_{-1} = V_0
    before = previous  # V_{K-2}
    K = 0
    for T in segments:
        for _ in range(T):
            used = {n: (v + lookahead * (v - before[n])).requires_grad_() for n, v in previous.items()}
            before, previous = previous, {n: p.detach().clone() for n, p in ref.named_parameters()}
            ref_losses, grads = [], None
            for mb in data[K * M:(K + 1) * M]:
                loss = mse(functional_call(ref, used, (input_fn(mb),)), mb)
                ref_losses.append(loss.item())
                g = torch.autograd.grad(loss * (1 / M), list(used.values()))
                grads = g if grads is None else [a + b for a, b in zip(grads, g)]
            for p, g in zip(ref.parameters(), grads):
                p.grad = g
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)

            losses = emu.train_window(data[K * M:(K + 1) * M])
            assert losses == pytest.approx(ref_losses, abs=1e-6)
            torch.testing.assert_close(flat(emu_stage), flat(ref), atol=1e-6, rtol=0)
            K += 1
        emu.drain()
    assert emu.weight_copies[0] <= 2


# ------------------------------------------------------ 2. hand-written scalar traces (P = 2)


class Scale(nn.Module):
    """y = w * x with a scalar weight (its gradient comes from the saved input only)."""

    def __init__(self, w: float):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(w, dtype=torch.float64))

    def forward(self, x):
        return self.w * x


class Square(nn.Module):
    """y = w * w * x: the backward reads w itself, so it shows which weights a backward sees."""

    def __init__(self, w: float):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(w, dtype=torch.float64))

    def forward(self, x):
        return self.w * self.w * x


XS = [0.5, -1.0, 1.5, 0.8, -0.3, 1.1, 0.7, -0.9, 0.2, -0.6, 1.3, 0.4]
CS = [1.0, 0.3, -0.7, 2.0, 0.4, -1.2, 0.9, 0.1, -0.5, 0.8, 1.4, -0.2]
LR = 0.1


def scalar_stream(n: int):
    return [(torch.tensor(XS[g], dtype=torch.float64), torch.tensor(CS[g], dtype=torch.float64)) for g in range(n)]


def scalar_loss(out, mb):
    return (out - mb[1]) ** 2


def run_scalar(schedule, first_stage, windows, M=1, options=AsyncOptions()):
    """Two scalar stages, plain SGD: (emulator, losses, [a, b after each window], (a, b) after the drain)."""
    stages = [first_stage, Scale(0.7)]
    emu = AsyncEmulator(
        schedule, stages, [torch.optim.SGD(s.parameters(), lr=LR) for s in stages], M, input_fn, scalar_loss,
        options=options,
    )
    data = scalar_stream(windows * M)
    losses, trace = [], []
    for t in range(windows):
        losses += emu.train_window(data[t * M:(t + 1) * M])
        trace += [stages[0].w.item(), stages[1].w.item()]
    emu.drain()
    return emu, losses, trace, (stages[0].w.item(), stages[1].w.item())


def test_pipedream_scalar_trace_M1_P2():
    """Stage 1 (w=0): F(g), B(g) at b_g. Stage 0 (w=1): F(g) and B(g) both at a_{max(g-1,0)} (stashed)."""
    a, b, expected_losses = [1.2], [0.7], []
    T = 4
    for g in range(T):
        x, c = XS[g], CS[g]
        a_used = a[max(g - 1, 0)]  # version floor((g - w) / M) = g - 1, the stash
        y = a_used * a_used * x
        z = b[g] * y
        expected_losses.append((z - c) ** 2)
        dz = 2 * (z - c)
        b.append(b[g] - LR * dz * y)
        a.append(a[g] - LR * dz * b[g] * 2 * a_used * x)  # STEP after B(g) updates the newest version a_g
    emu, losses, trace, final = run_scalar("pipedream", Square(1.2), T)
    assert losses == pytest.approx(expected_losses, abs=1e-12)
    # after window t: stage 1 stepped t+1 times, stage 0 (one window behind) t times
    assert trace == pytest.approx([v for t in range(T) for v in (a[t], b[t + 1])], abs=1e-12)
    assert final == pytest.approx((a[T], b[T]), abs=1e-12)
    assert emu.weight_copies == [2, 1] and emu.step_counts == [T, T]
    assert emu.staleness() == pytest.approx([(T - 1) / T, 0.0])


@pytest.mark.parametrize("correction", [False, True])
def test_pipemare_scalar_trace_M1_P2(correction):
    """Stage 0: F(g) at a_{g-1} (current at F); B(g) at the current a_g, or a_g - tau*delta_g with T2
    (tau = 1 for g >= 1).

    T1: tau_hat = max(1, ceil(1/1)) = 1, so the lr is unchanged on both stages.
    """
    gamma = 0.9
    a, b, delta, expected_losses = [1.2], [0.7], [0.0], []
    T = 5
    for g in range(T):
        x, c = XS[g], CS[g]
        a_fwd = a[max(g - 1, 0)]
        tau = 1 if g >= 1 else 0
        a_bwd = a[g] - tau * delta[g] if correction else a[g]
        y = a_fwd * a_fwd * x
        z = b[g] * y
        expected_losses.append((z - c) ** 2)
        dz = 2 * (z - c)
        b.append(b[g] - LR * dz * y)
        a.append(a[g] - LR * dz * b[g] * 2 * a_bwd * x)  # live: backward reads w at B time, activation from F
        delta.append(gamma * delta[g] + (1 - gamma) * (a[g + 1] - a[g]))
    options = AsyncOptions(PipeMareOptions(correction=correction, correction_decay=gamma))
    emu, losses, trace, final = run_scalar("pipemare", Square(1.2), T, options=options)
    assert losses == pytest.approx(expected_losses, abs=1e-12)
    assert trace == pytest.approx([v for t in range(T) for v in (a[t], b[t + 1])], abs=1e-12)
    assert final == pytest.approx((a[T], b[T]), abs=1e-12)
    assert emu.weight_copies == ([2, 2] if correction else [1, 1])


def test_pipemare_scalar_trace_M1_P3_with_T1_and_T2():
    """P=3, M=1: stage s forwards at W after g-w_s STEPs and backwards at W_g - tau_s(g) * delta_g,
    tau_s(g) = min(g, w_s). T1 scales stage 0's lr (tau_hat = 2) by 2 ** -(1 - min(k/K, 1)); stages 1, 2 have tau_hat 1.
    T2's per-stage decay (the default) averages stage 0's velocity with gamma ** (1 / 2), stage 1's with gamma.
    """
    gamma, K, T = 0.9, 3, 7
    gamma0 = gamma ** (1 / 2)
    a, b, c = [1.2], [0.7], [-0.8]
    da, db = [0.0], [0.0]  # velocities of stages 0 and 1 (stage 2 has tau = 0, its velocity is never used)
    expected_losses = []
    for g in range(T):
        x, target = XS[g], CS[g]
        a_f, b_f, c_f = a[max(g - 2, 0)], b[max(g - 1, 0)], c[g]
        y0 = a_f * a_f * x
        y1 = b_f * y0
        z = c_f * y1
        expected_losses.append((z - target) ** 2)
        dz = 2 * (z - target)
        c.append(c[g] - LR * dz * y1)
        dy1 = dz * c[g]
        b_bwd = b[g] - min(g, 1) * db[g]
        b.append(b[g] - LR * dy1 * y0)  # weight gradient from the saved input only
        db.append(gamma * db[g] + (1 - gamma) * (b[g + 1] - b[g]))
        dy0 = dy1 * b_bwd  # input gradient reads the (corrected) live weight
        a_bwd = a[g] - min(g, 2) * da[g]
        lr0 = LR * 2 ** -(1 - min(g / K, 1))  # stage 0's STEP number g
        a.append(a[g] - lr0 * dy0 * 2 * a_bwd * x)
        da.append(gamma0 * da[g] + (1 - gamma0) * (a[g + 1] - a[g]))

    stages = [Square(1.2), Scale(0.7), Scale(-0.8)]
    emu = AsyncEmulator(
        "pipemare", stages, [torch.optim.SGD(s.parameters(), lr=LR) for s in stages], 1, input_fn, scalar_loss,
        options=AsyncOptions(PipeMareOptions(lr_warmup_steps=K, correction_decay=gamma)),
    )
    data = scalar_stream(T)
    losses = []
    for t in range(T):
        losses += emu.train_window(data[t:t + 1])
        assert [s.w.item() for s in stages] == pytest.approx([a[max(t - 1, 0)], b[t], c[t + 1]], abs=1e-12)
    emu.drain()
    assert losses == pytest.approx(expected_losses, abs=1e-12)
    assert [s.w.item() for s in stages] == pytest.approx([a[T], b[T], c[T]], abs=1e-12)
    assert emu.staleness() == pytest.approx([sum(min(g, 2) for g in range(T)) / T, (T - 1) / T, 0.0])


def test_xpipe_scalar_trace_M1_P2_plain_sgd():
    """P=2, M=1: stage 0 has s_f = 1, s_b = 0; stage 1 has s_f = s_b = 0. Delta = last applied gradient.

    F(g) on stage 0 runs when it has done g-1 STEPs: Pred(a_{g-1}, 1) = a_{g-1} - lr * G_{g-2} (Delta = 0
    before the first STEP); B(g) runs at a_g (Pred with distance 0).
    """
    assert xpipe_distances(0, 2, 1) == (1, 0) and xpipe_distances(1, 2, 1) == (0, 0)
    a, b, G, expected_losses = [1.2], [0.7], [], []
    T = 5
    for g in range(T):
        x, c = XS[g], CS[g]
        a_fwd = a[g - 1] - LR * G[g - 2] if g >= 2 else a[0]
        a_bwd = a[g]
        y = a_fwd * a_fwd * x
        z = b[g] * y
        expected_losses.append((z - c) ** 2)
        dz = 2 * (z - c)
        b.append(b[g] - LR * dz * y)
        G.append(dz * b[g] * 2 * a_bwd * x)
        a.append(a[g] - LR * G[g])
    emu, losses, trace, final = run_scalar("xpipe", Square(1.2), T)
    assert losses == pytest.approx(expected_losses, abs=1e-12)
    assert trace == pytest.approx([v for t in range(T) for v in (a[t], b[t + 1])], abs=1e-12)
    assert final == pytest.approx((a[T], b[T]), abs=1e-12)


def test_xpipe_scalar_trace_M2_P2_caches_per_minibatch():
    """P = M = 2, plain SGD (Delta = last applied gradient G); s_f = s_b = 1 on both stages.

    Stage 1 (w=0) runs F(2t) B(2t) F(2t+1) B(2t+1) STEP: both caches hold b_t - lr*G^b_{t-1}.
    Stage 0 (w=1) runs F(2t) [B(2t-1) STEP] F(2t+1) B(2t): its bellwether F(2t) predicts from a_{t-1}
    (t-1 STEPs done), and F(2t+1) reuses that prediction although a STEP ran in between; its first B,
    B(2t), predicts from a_t and B(2t+1) (next window) reuses it.
    """
    M, T = 2, 5
    a, b, Ga, Gb, expected_losses = [1.2], [0.7], [], [], []
    for t in range(T):
        b_pred = b[t] - LR * Gb[t - 1] if t >= 1 else b[0]
        a_fwd = a[t - 1] - LR * Ga[t - 2] if t >= 2 else a[0]
        a_bwd = a[t] - LR * Ga[t - 1] if t >= 1 else a[0]
        ga = gb = 0.0
        for i in range(M):
            x, c = XS[t * M + i], CS[t * M + i]
            y = a_fwd * a_fwd * x
            z = b_pred * y
            expected_losses.append((z - c) ** 2)
            dz = 2 * (z - c) / M
            gb += dz * y
            ga += dz * b_pred * 2 * a_bwd * x
        Ga.append(ga)
        Gb.append(gb)
        a.append(a[t] - LR * ga)
        b.append(b[t] - LR * gb)
    assert xpipe_distances(0, 2, 2) == (1, 1) and xpipe_distances(1, 2, 2) == (1, 1)
    emu, losses, trace, final = run_scalar("xpipe", Square(1.2), T, M=M)
    assert losses == pytest.approx(expected_losses, abs=1e-12)
    assert trace == pytest.approx([v for t in range(T) for v in (a[t], b[t + 1])], abs=1e-12)
    assert final == pytest.approx((a[T], b[T]), abs=1e-12)
    assert emu.weight_copies == [3, 3]


def test_2bw_scalar_trace_across_a_drain():
    """P = M = 2: every F and B of mini-batch K (global) uses V_{max(K-1, 0)} on both stages, also after a drain."""
    M = 2
    segments = [2, 3]
    n_batches = sum(segments)
    data = scalar_stream(n_batches * M)
    a, b, expected_losses = [1.2], [0.7], []
    for K in range(n_batches):
        av, bv = a[max(K - 1, 0)], b[max(K - 1, 0)]
        ga = gb = 0.0
        for i in range(M):
            x, c = XS[K * M + i], CS[K * M + i]
            y = av * av * x
            z = bv * y
            expected_losses.append((z - c) ** 2)
            dz = 2 * (z - c) / M
            gb += dz * y
            ga += dz * bv * 2 * av * x
        a.append(a[K] - LR * ga)
        b.append(b[K] - LR * gb)

    stages = [Square(1.2), Scale(0.7)]
    emu = AsyncEmulator(
        "pipedream_2bw", stages, [torch.optim.SGD(s.parameters(), lr=LR) for s in stages], M, input_fn, scalar_loss,
        options=AsyncOptions(pipedream_2bw=DoubleBufferOptions(lookahead=0.0)),  # the paper's rule, traced by hand
    )
    losses, K = [], 0
    for T in segments:
        for _ in range(T):
            losses += emu.train_window(data[K * M:(K + 1) * M])
            K += 1
        emu.drain()
        assert (stages[0].w.item(), stages[1].w.item()) == pytest.approx((a[K], b[K]), abs=1e-12)
    assert losses == pytest.approx(expected_losses, abs=1e-12)
    assert max(emu.weight_copies) <= 2


# ------------------------------------------------------------------ 3. weight-copy bounds


def run_segments(emu: AsyncEmulator, M: int, segments=(8, 3), seed: int = 1) -> None:
    data = micro_batch_stream(sum(segments) * M, seed=seed)
    t = 0
    for T in segments:
        for _ in range(T):
            emu.train_window(data[t * M:(t + 1) * M])
            t += 1
        emu.drain()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_weight_copies_within_section_11_bounds(schedule):
    for P, M in valid_shapes(schedule):
        for correction in ([False, True] if schedule == "pipemare" else [True]):
            emu = emulator(schedule, mlp_stages(P), "adam", M, options=AsyncOptions(PipeMareOptions(correction=correction)))
            run_segments(emu, M)
            copies = emu.weight_copies
            for s in range(P):
                tau_bar = math.ceil((P - 1 - s) / M)
                if schedule == "pipedream":
                    assert copies[s] == tau_bar + 1, (P, M, s, copies)  # stashes; the master is extra
                elif schedule == "pipedream_2bw":
                    assert 1 <= copies[s] <= 2, (P, M, s, copies)
                elif schedule == "pipemare":
                    assert copies[s] == (2 if correction else 1), (P, M, s, copies)  # live storage (+ delta)
                else:
                    assert copies[s] <= 3, (P, M, s, copies)  # live storage + forward and backward caches


def test_2bw_rejects_fewer_micro_batches_than_stages():
    with pytest.raises(ValueError, match="M >= P"):
        emulator("pipedream_2bw", mlp_stages(3), "sgd", 2)


# ------------------------------------------------------------------------ 4. staleness


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_staleness_matches_the_formula(schedule):
    segments = (4, 3)
    for P, M in valid_shapes(schedule):
        emu = emulator(schedule, mlp_stages(P), "sgd_momentum", M)
        run_segments(emu, M, segments)
        means = emu.staleness()
        assert means[-1] == 0.0
        for s in range(P):
            w = P - 1 - s
            taus = [
                sum(1 for n in range(max(0, g - w), g) if n % M == M - 1)
                for T in segments
                for g in range(T * M)
            ]
            assert means[s] == pytest.approx(sum(taus) / len(taus)), (P, M, s)


# ---------------------------------------------------------------------- 5. step counts


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_stage_steps_once_per_window(schedule):
    P, M = 4, 4
    emu = emulator(schedule, mlp_stages(P), "adam", M)
    data = micro_batch_stream(7 * M)
    done = 0
    for T in (4, 3):
        for t in range(T):
            emu.train_window(data[(done + t) * M:(done + t + 1) * M])
            # in window t stage s has run B(n) for n <= (t+1)M - 1 - w_s, i.e. floor(((t+1)M - w_s) / M) STEPs
            assert emu.step_counts == [done + ((t + 1) * M - (P - 1 - s)) // M for s in range(P)]
        emu.drain()
        done += T
        assert emu.step_counts == [done] * P


# ------------------------------------------------------------------------------ extras


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stage_visit_order_does_not_matter(schedule):
    P, M = 3, 4
    results = []
    for order in (list(range(P)), list(reversed(range(P)))):
        stages = mlp_stages(P)
        emu = emulator(schedule, stages, "adam", M)
        emu._stage_order = order
        run_segments(emu, M, (3, 2))
        results.append([flat(s) for s in stages])
    for x, y in zip(*results):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


def test_pipemare_lr_reschedule():
    """Bias-adding stages and loss sum(out): every gradient is 1/M, so W moves by exactly lr * factor per STEP."""

    class Bias(nn.Module):
        def __init__(self):
            super().__init__()
            self.b = nn.Parameter(torch.zeros((), dtype=torch.float64))

        def forward(self, x):
            return x + self.b

    P, M, T, K = 3, 1, 6, 4
    stages = [Bias() for _ in range(P)]
    opts = [torch.optim.SGD(s.parameters(), lr=LR) for s in stages]
    emu = AsyncEmulator(
        "pipemare", stages, opts, M, input_fn, lambda out, mb: out.sum(),
        options=AsyncOptions(PipeMareOptions(lr_warmup_steps=K)),
    )
    for t in range(T):
        emu.train_window([(torch.tensor(float(t), dtype=torch.float64), None)])
    emu.drain()
    for s in range(P):
        tau_hat = max(1, math.ceil((P - 1 - s) / M))
        factors = [tau_hat ** -(1 - min(k / K, 1)) for k in range(T)]
        assert factors == pytest.approx([pipemare_lr_factor(k, P - 1 - s, M, K) for k in range(T)])
        assert stages[s].b.item() == pytest.approx(-LR * sum(factors), abs=1e-12)
        assert opts[s].param_groups[0]["lr"] == LR  # scaled for the STEP only
    assert pipemare_lr_factor(0, 2, 1, K) == 0.5


def test_argument_errors():
    with pytest.raises(ValueError, match="unknown asynchronous schedule"):
        emulator("gpipe", mlp_stages(2), "sgd", 2)
    with pytest.raises(ValueError, match="cannot infer"):
        stages = mlp_stages(2)
        AsyncEmulator("xpipe", stages, [torch.optim.RMSprop(s.parameters()) for s in stages], 2, input_fn, mse)
    emu = emulator("pipedream", mlp_stages(2), "sgd", 2)
    with pytest.raises(ValueError, match="1 to M=2"):
        emu.train_window(micro_batch_stream(3))
