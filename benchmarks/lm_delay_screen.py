"""Screen optimizer settings and corrections under a one-step gradient delay, in a plain training loop.

PipeDream-2BW's rule, ``W(t+1) = W(t) - step(grad f(W(t-1)))``, written as a plain loop on one device
(no pipeline, no lightning_pipe): the same character-level transformer, data and validation as
``lm_quality.py`` (P = 2's 4 blocks), so a candidate fix can be tried in about a minute per run before
it is built into a weight policy. ``--delay 0`` is ordinary training, the baseline.

Corrections (``--fix``):

* ``weight-extrapolation``: the gradient is taken at ``W(t-1) + kappa * (W(t-1) - W(t-2))`` (what
  ``PipeStrategy(pipedream_2bw={"lookahead": kappa})`` does in the pipeline);
* ``update-extrapolation``: the update applied is ``u(t) + kappa * (u(t) - u(t-1))``, ``u`` the
  optimizer's update from the stale gradient (an error-feedback-style correction of the previous
  step's stale update);
* ``delay-compensation``: DC-ASGD's first-order correction of the stale gradient (Zheng et al., "Asynchronous
  Stochastic Gradient Descent with Delay Compensation", ICML 2017, arXiv 1609.08326),
  ``g + lambda * g * g * (W(t) - W(t-1))`` element-wise, the Hessian approximated by the gradient's outer
  product's diagonal; ``lambda = kappa`` (DC-ASGD-c) or, with ``--dc-adaptive``, ``kappa / sqrt(MS)``, MS
  the gradient's element-wise mean square averaged with 0.95 (DC-ASGD-a).

    python benchmarks/lm_delay_screen.py --delay 0
    python benchmarks/lm_delay_screen.py --delay 1 --fix weight-extrapolation --kappa 1 --optimizer muon

``--delayed REGEX`` delays only the parameters whose name matches (``attn``, ``mlp``, ``emb|head``...):
where in the model the delay costs. Each run appends one JSON line (its arguments, the validation curve,
the gradient norm every 25 steps, the final loss) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lm_quality  # noqa: E402  (the model and the data)

DEFAULT_OUT = lm_quality.REPO / "benchmarks" / "results" / "lm_delay_screen.jsonl"


def optimizers(model: torch.nn.Module, args: argparse.Namespace) -> list[torch.optim.Optimizer]:
    """AdamW (``--beta1``, ``--beta2``), NAdamW (the same betas), SGD with momentum ``--beta1``, or Muon (lr ``--muon-lr``) for the
    blocks' matrices with AdamW for the rest, as in lm_quality.py."""
    if args.optimizer == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps,
                                  weight_decay=0.0)]
    if args.optimizer == "nadamw":  # arXiv 2505.01099's optimizer: NAdam with decoupled weight decay
        return [torch.optim.NAdam(model.parameters(), lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps,
                                  weight_decay=0.0, decoupled_weight_decay=True)]
    if args.optimizer == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.beta1)]
    matrices = [p for p in model.blocks.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
    return [torch.optim.Muon(matrices, lr=args.muon_lr, weight_decay=0.0),
            torch.optim.AdamW(rest, lr=args.lr, betas=(args.beta1, 0.95), weight_decay=0.0)]


def lr_factor(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over ``--warmup`` steps, then (``--cosine``) cosine decay to 10 %."""
    factor = min(1.0, (step + 1) / args.warmup) if args.warmup else 1.0
    if args.cosine:
        factor *= 0.1 + 0.45 * (1 + math.cos(math.pi * min(step / args.steps, 1.0)))
    return factor


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    classes = lm_quality._lightning_classes()
    data = classes["BrownDataModule"](args.data, 64, 32, args.steps, args.seed, 256, 64)
    torch.manual_seed(args.seed)
    model = classes["CharLM"](len(data.vocab), blocks=4)
    params = list(model.parameters())
    delayed = [re.search(args.delayed, name) is not None for name, _ in model.named_parameters()]  # --delayed
    opts = optimizers(model, args)
    base_lrs = [[group["lr"] for group in o.param_groups] for o in opts]
    previous = [p.detach().clone() for p in params]  # W(t-1)
    before = [p.detach().clone() for p in params]  # W(t-2)
    last_update = [torch.zeros_like(p) for p in params]
    mean_square = [torch.zeros_like(p) for p in params]  # DC-ASGD-a's MS
    windows = list(data.val_dataloader())

    def validate() -> float:
        model.eval()
        with torch.no_grad():
            losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in windows]
        model.train()
        return sum(losses) / len(losses)

    curve, grad_norms, started = [], [], time.perf_counter()
    for t, (x, y) in enumerate(data.train_dataloader()):
        for o, lrs in zip(opts, base_lrs):
            for group, lr in zip(o.param_groups, lrs):
                group["lr"] = lr * lr_factor(t, args)
        current = [p.detach().clone() for p in params]
        with torch.no_grad():  # the weights the gradient is taken at
            if args.delay:
                kappa = args.kappa if args.fix == "weight-extrapolation" else 0.0
                for p, w1, w2, stale in zip(params, previous, before, delayed):
                    if stale:
                        p.copy_(w1 + kappa * (w1 - w2))
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        if args.delay and args.fix == "delay-compensation":
            with torch.no_grad():
                for p, w, w1, stale, ms in zip(params, current, previous, delayed, mean_square):
                    if stale and p.grad is not None:
                        g = p.grad
                        scale = args.kappa
                        if args.dc_adaptive:
                            ms.mul_(0.95).addcmul_(g, g, value=0.05)
                            scale = args.kappa / (ms.sqrt() + 1e-12)
                        g.add_(scale * g * g * (w - w1))
        if t % 25 == 0:
            grad_norms.append([t, round(torch.nn.utils.get_total_norm([p.grad for p in params]).item(), 4)])
        with torch.no_grad():
            for p, w in zip(params, current):
                p.copy_(w)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        with torch.no_grad():
            if args.fix == "update-extrapolation":
                for p, w, u_last in zip(params, current, last_update):
                    u = p - w
                    p.add_(u - u_last, alpha=args.kappa)
                    u_last.copy_(u)
            for w2, w1, w in zip(before, previous, current):
                w2.copy_(w1)
                w1.copy_(w)
        if (t + 1) % 25 == 0:
            curve.append([t + 1, round(validate(), 5)])
            print(f"step {t + 1}: val_loss {curve[-1][1]:.4f}", flush=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("out", "data")}
    return {**config, "final_val_loss": curve[-1][1], "val_curve": curve, "grad_norm_curve": grad_norms,
            "seconds": round(time.perf_counter() - started)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--delay", type=int, default=1, choices=[0, 1], help="gradient delay in steps (0: ordinary training)")
    p.add_argument("--fix", default="none", choices=["none", "weight-extrapolation", "update-extrapolation", "delay-compensation"])
    p.add_argument("--dc-adaptive", action="store_true", help="delay-compensation: DC-ASGD-a's adaptive lambda")
    p.add_argument("--kappa", type=float, default=1.0, help="the correction's scale (default 1)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "nadamw", "sgd", "muon"])
    p.add_argument("--beta1", type=float, default=0.9, help="Adam's beta1 / SGD's momentum (default 0.9)")
    p.add_argument("--beta2", type=float, default=0.95, help="Adam's beta2 (default 0.95)")
    p.add_argument("--eps", type=float, default=1e-8, help="Adam's eps (default 1e-8)")
    p.add_argument("--delayed", default="", help="delay only parameters whose name matches this regex (default: all)")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW / SGD learning rate (default 2e-3)")
    p.add_argument("--muon-lr", type=float, default=0.02)
    p.add_argument("--warmup", type=int, default=0, help="linear warm-up steps (default 0)")
    p.add_argument("--cosine", action="store_true", help="cosine decay to 10 %% at the last step")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, default=lm_quality.DEFAULT_DATA)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    record = run(args)
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    shown = ("delay", "delayed", "fix", "kappa", "dc_adaptive", "optimizer", "final_val_loss", "seconds")
    print(json.dumps({k: record.get(k) for k in shown}))


if __name__ == "__main__":
    main()
