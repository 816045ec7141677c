"""GPU against CPU: the same GPT, seed and batches trained 5 steps on each device; the losses
and every parameter must agree (float64: 1e-10, float32: 1e-4, relative to max(1, |value|)).

    python tests/scripts/gpu_vs_cpu.py --device cuda --dtype float64
    python tests/scripts/gpu_vs_cpu.py --device cuda --dtype float32

Prints one JSON line {"check", "dtype", "device", "losses_cpu", "losses_dev",
"max_loss_diff", "max_param_diff", "worst_param", "tol", "ok"}; exit status 1 when not ok.
Run by tests/gpu_acceptance.sh; tests/test_gpu_acceptance.py runs it with --device cpu.
float64 steps AdamW (the real optimizer: gradients agree to ~1e-13 there); float32 steps SGD,
because Adam's first step is ~lr * sign(g) and flips on gradients near zero.
"""
import argparse
import json
import sys

import numpy as np

from minidist import backend
from minidist.nn import GPT, GPTConfig
from minidist.optim import SGD, AdamW

TOL = {"float64": 1e-10, "float32": 1e-4}
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=96, dropout=0.0)


def run(device, dtype, steps=5, seed=7):
    """(losses, {name: host parameter}) after `steps` steps on `device`."""
    backend.set_device(device)
    model = GPT(CFG, seed=seed, dtype=dtype)
    make = AdamW if dtype == "float64" else SGD
    opt = make(model.named_parameters(), lr=1e-2)
    r = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        x = r.integers(0, CFG.vocab_size, (4, CFG.block_size))
        _, loss = model(x, np.roll(x, -1, axis=1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(backend.to_host(loss.data)))
    return losses, {n: backend.to_host(p.data) for n, p in model.named_parameters()}


def rel_diff(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(1.0, np.abs(b)))) if a.size else 0.0


def main():
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--dtype", choices=tuple(TOL), default="float64")
    args = p.parse_args()
    losses_cpu, params_cpu = run("cpu", args.dtype)
    losses_dev, params_dev = run(args.device, args.dtype)
    diffs = {n: rel_diff(params_dev[n], params_cpu[n]) for n in params_cpu}
    worst = max(diffs, key=lambda n: np.inf if np.isnan(diffs[n]) else diffs[n])  # NaN worst
    out = {"check": f"gpu_vs_cpu_{args.dtype}", "dtype": args.dtype, "device": args.device,
           "losses_cpu": losses_cpu, "losses_dev": losses_dev,
           "max_loss_diff": rel_diff(losses_dev, losses_cpu), "max_param_diff": diffs[worst],
           "worst_param": worst, "tol": TOL[args.dtype]}
    out["ok"] = bool(np.isfinite(losses_dev).all() and out["max_loss_diff"] <= out["tol"]
                     and out["max_param_diff"] <= out["tol"])
    print(json.dumps(out))
    sys.exit(0 if out["ok"] else 1)


if __name__ == "__main__":
    main()
