"""Options of the weight policies, one dataclass per schedule that has any.

``PipeStrategy`` takes them as groups (``pipemare=PipeMareOptions(...)``, ``xpipe=...``,
``avgpipe=...``); LightningCLI renders each group as a nested block. The constants the papers leave
open are defaults here (docs/algorithms.md marks which ones were verified).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Prediction = Literal["auto", "adam", "muon", "momentum", "sgd"]
Distances = Literal["paper", "exact"]
MomentumDirection = Literal["buffer", "spectrain"]
DecayRule = Literal["fixed", "per_stage"]
Averaging = Literal["async", "sync"]


@dataclass(frozen=True)
class PipeDreamOptions:
    """pipedream's options (docs/algorithms.md §6).

    Args:
        vertical_sync: PipeDream's optional *vertical sync*: every stage runs a micro-batch's forward
            and backward on the weight version the first stage used for it (each stage keeps the
            versions it will still need), so that all stages compute one mini-batch's gradient on one
            consistent version; the last stages' gradients then become as stale as the first's. Off
            (the default) as in the paper's default configuration: each stage uses its newest
            weights at the forward and stashes them for the backward.
    """

    vertical_sync: bool = False


@dataclass(frozen=True)
class PipeMareOptions:
    """PipeMare's two techniques (docs/algorithms.md §8).

    Args:
        lr_reschedule: T1: stage ``s`` starts at ``lr / tau_s`` and reaches ``lr`` geometrically over
            ``lr_warmup_steps`` of its optimizer steps (the last stage is unaffected).
        lr_warmup_steps: length ``K`` of T1, in optimizer steps (at least 1; ``lr_reschedule=False`` turns T1 off).
        correction: T2: backwards run with weights corrected by ``-tau * delta``, an exponential average
            of recent updates (one extra weight copy).
        correction_decay: decay ``gamma`` of T2's average, in ``[0, 1)``.
        correction_decay_rule: ``"per_stage"`` (the default): stage ``s`` decays by
            ``correction_decay ** (1 / tau_hat_s)``, ``tau_hat_s`` its delay in STEPs (the form recorded
            for the paper, not verified against its text; docs/fidelity.md M6), so that a stage whose
            gradients are staler averages over more STEPs; ``"fixed"``: every stage by
            ``correction_decay`` (the earlier default). The two differ only where a stage is more
            than one STEP stale (``stages - 1 - s > micro_batches``, e.g. P = 8 at M = 4), where the
            language-model benchmark ends closer to synchronous training with ``"per_stage"`` under
            AdamW and SGD, slightly further under Muon (docs/lm-quality.md).
    """

    lr_reschedule: bool = True
    lr_warmup_steps: int = 100
    correction: bool = True
    correction_decay: float = 0.9
    correction_decay_rule: DecayRule = "per_stage"


@dataclass(frozen=True)
class DoubleBufferOptions:
    """pipedream_2bw's options (docs/algorithms.md §7).

    Args:
        lookahead: extrapolate the one-step-stale version along the last update: every forward and
            backward of mini-batch ``K`` runs on ``W(K-1) + lookahead * (W(K-1) - W(K-2))`` instead of
            ``W(K-1)``. ``1.0`` predicts ``W(K)``, the weights the gradient updates, when two
            consecutive updates are equal (a weight prediction that needs no optimizer formula, so it
            works with any optimizer); ``2.0`` (the default) looks one update further, as a Nesterov
            step evaluates the gradient ahead of the weights it updates. It costs one more
            weight-sized copy (``W(K-2)``). ``0.0`` is the paper's rule. The default is not the paper's
            because the language-model benchmark (docs/lm-quality.md) ends closer to synchronous
            training with it: with AdamW and Muon at P = 2 and 4, 2.0 better than 1.0 and 1.0 better
            than 0.0; at no measurable throughput cost (docs/async-throughput.md).
        delay_compensation: ``lambda_0`` of DC-ASGD-a's correction of the stale gradient (Zheng et al.,
            ICML 2017, arXiv 1609.08326; docs/algorithms.md §7): before each STEP a gradient ``g``
            taken at weights ``W_used`` becomes ``g + lambda_0 * g * g * (W - W_used) / sqrt(MS)``
            element-wise, ``W`` the weights it updates and ``MS`` an average of ``g * g`` (a
            first-order Taylor step with the Hessian's diagonal approximated by ``g * g``). ``0`` (the
            default) is off; costs one more weight-sized buffer. docs/lm-quality.md measures it.
        delay_compensation_decay: how much of ``MS`` each STEP keeps (DC-ASGD-a's 0.95).
    """

    lookahead: float = 2.0
    delay_compensation: float = 0.0
    delay_compensation_decay: float = 0.95


@dataclass(frozen=True)
class XPipeOptions:
    """XPipe's weight prediction (docs/algorithms.md §9).

    Args:
        prediction: the update direction the prediction extrapolates: ``"adam"`` (Adam's bias-corrected
            moments; NAdam's too), ``"muon"`` (Muon's orthogonalised momentum at its shape-adjusted
            learning rate), ``"momentum"`` (SGD's momentum buffer), ``"sgd"`` (the last gradient) or
            ``"auto"`` (by the optimizer's type, per member of a
            :class:`~lightning_pipe.optim.CombinedOptimizer`).
        distances: how many STEPs ahead a mini-batch's predictions look. ``"paper"`` (the default):
            XPipe's formulas ``s_f``, ``s_b`` per stage (docs/algorithms.md §9), which average the lag
            over a mini-batch's micro-batches; with ``M > 1`` they can make its forward and its backward
            target different versions, and the backward look a STEP beyond the weights its gradient
            updates. ``"exact"``: both target the version the mini-batch's STEP updates, counted from
            this stage's own STEPs: the forward predicts the STEPs its stage takes before then, the
            backward runs on the weights as they are (docs/fidelity.md X8).
        momentum_direction: the ``"momentum"`` prediction's direction for SGD with momentum:
            ``"buffer"`` (the default), the momentum buffer ``buf``; ``"spectrain"``, ``momentum * buf +
            (1 - dampening) * g`` with ``g`` the last applied gradient, as SpecTrain's and PipeOptim's
            published code predict (the step SGD with Nesterov momentum would take; docs/fidelity.md X6).
    """

    prediction: Prediction = "auto"
    distances: Distances = "paper"
    momentum_direction: MomentumDirection = "buffer"


@dataclass(frozen=True)
class AsyncOptions:
    """The options every asynchronous weight policy is given (each reads its own group).

    Args:
        delay_warmup_steps: ``K`` of the delay-scaled learning-rate warm-up, read by every stale
            schedule (pipedream, pipedream_2bw, pipemare, xpipe): a stage whose gradients are
            ``tau_s >= 1`` STEPs stale (``ceil(w_s / M)``; 1 on every stage of 2BW) multiplies its
            learning rate by ``min(1, (k + 1) / (K * tau_s))`` at its ``k``-th STEP, a linear warm-up
            over ``K * tau_s`` STEPs; fresh stages (``tau_s = 0``, e.g. pipedream's last) are untouched.
            ``0`` (the default): off. docs/algorithms.md §5.
        grad_cosine_every: measure ``pipe/stage{s}/grad_cosine`` on every ``K``-th training step (one
            micro-batch per stage; docs/metrics.md); ``0`` (the default): never.
    """

    pipemare: PipeMareOptions = field(default_factory=PipeMareOptions)
    xpipe: XPipeOptions = field(default_factory=XPipeOptions)
    pipedream_2bw: DoubleBufferOptions = field(default_factory=DoubleBufferOptions)
    pipedream: PipeDreamOptions = field(default_factory=PipeDreamOptions)
    delay_warmup_steps: int = 0
    grad_cosine_every: int = 0


@dataclass(frozen=True)
class AvgPipeOptions:
    """avgpipe: parallel pipelines on the same devices joined by elastic averaging (docs/avgpipe.md).

    Args:
        parallel_pipelines: pipeline replicas ``N`` on the same devices. Each Lightning batch is split
            into ``N`` replica mini-batches (so the batch size is ``N × B``), each into ``micro_batches``
            micro-batches; the logged loss is the mean over replicas. ``"auto"``: chosen by the tuner at
            fit start (with ``micro_batches="auto"`` and ``advance_forward="auto"`` as well, if given).
        alpha: elastic averaging rate; ``None`` means ``0.9 / parallel_pipelines``.
        period: average every that many rounds (batches).
        averaging: ``"async"`` (each replica averages right after its step) or ``"sync"`` (after all
            replicas stepped, against the round's starting center).
        advance_forward: extra warm-up forwards ``a`` on every stage but the last (1F1B when 0;
            ``micro_batches`` or more: all forwards first); costs ``a`` more micro-batches of
            activations. ``"auto"``: the tuner tries 0, 1 and 2.
        trials: when any option is ``"auto"``: how many of the best predicted candidates run a few
            rounds on the devices at fit start (on copies of the stages, so training is unchanged)
            before the fastest measured is chosen; ``0`` or ``1`` trusts the prediction alone.
    """

    parallel_pipelines: int | Literal["auto"] = 2
    alpha: float | None = None
    period: int = 1
    averaging: Averaging = "async"
    advance_forward: int | Literal["auto"] = 0
    trials: int = 3

    @property
    def resolved_alpha(self) -> float:
        """``alpha``, or ``0.9 / N`` (EASGD's guidance) when not given; ``N`` must be resolved."""
        if self.alpha is not None:
            return self.alpha
        if self.parallel_pipelines == "auto":
            raise ValueError("alpha depends on parallel_pipelines, which the tuner has not chosen yet.")
        return 0.9 / self.parallel_pipelines

    @property
    def tuned(self) -> bool:
        """Whether the tuner chooses any of the values."""
        return "auto" in (self.parallel_pipelines, self.advance_forward)
