"""VaLLA paper Fig. 4 (FMNIST OOD-AUC): how far the test sets can order the methods.

The setting of ``gaussify.experiments.function_space_images`` on Fashion-MNIST (2000 training
images, 784-100-100-10 tanh MLP, seed 0; 500 FMNIST test images against 500 MNIST test
images, OOD score = predictive entropy of the probit predictive). Every method of the table is
fitted on the same network (the experiment's ``_fit``), and the AUROC differences VaLLA - other
are bootstrapped pairwise: both test sets resampled with replacement, the same draw for every
method (2000 draws). Reports each method's AUROC, its bootstrap standard error, and for each
other method the difference, its standard error and the fraction of draws where VaLLA is ahead.
Writes ``benchmarks/results/valla_ood_bootstrap.json``.
"""

from __future__ import annotations

import json
import os
import time

import torch

from gaussify import metrics
from gaussify.experiments import function_space_images as fi
from gaussify.experiments._runner import train_map_eval


def main(draws: int = 2000) -> dict[str, object]:
    torch.set_num_threads(1)
    load0, start = os.getloadavg(), time.perf_counter()
    cfg = {
        "seed": 0, "max_train": 2000, "max_test": 500, "width": 100, "epochs": 10,
        "fl_subset": 200, "ella_landmarks": 200, "num_inducing": 200, "valla_epochs": 10,
    }  # fmt: skip
    ds, other = fi._load("fashion_mnist", cfg), fi._load("mnist", cfg)
    x_in, x_out = ds.x_test[: cfg["max_test"]], other.x_test[: cfg["max_test"]]
    x, y = ds.x_train, ds.y_train
    model = fi.make_mlp(x.shape[1], cfg["width"], 10, cfg["seed"])
    train_map_eval(model, (x, y), "classification", cfg, batch_size=128)
    ent: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for method in fi.METHODS:
        post = fi._fit(method, model, (x, y), (ds.x_val, ds.y_val), cfg)
        p_in, p_out = fi._probs(post, model, x_in), fi._probs(post, model, x_out)
        ent[method] = (metrics.predictive_entropy(p_in), metrics.predictive_entropy(p_out))
        print(method, metrics.ood_auroc(p_in, p_out), flush=True)
    n_in, n_out = x_in.shape[0], x_out.shape[0]
    labels = torch.cat([torch.zeros(n_in, dtype=torch.bool), torch.ones(n_out, dtype=torch.bool)])
    gen = torch.Generator().manual_seed(0)
    boot: dict[str, list[float]] = {m: [] for m in ent}
    for _ in range(draws):
        i = torch.randint(n_in, (n_in,), generator=gen)
        o = torch.randint(n_out, (n_out,), generator=gen)
        for m, (e_in, e_out) in ent.items():
            boot[m].append(metrics.auroc(torch.cat([e_in[i], e_out[o]]), labels))
    full = {m: metrics.auroc(torch.cat(e), labels) for m, e in ent.items()}
    b = {m: torch.tensor(v, dtype=torch.float64) for m, v in boot.items()}
    out: dict[str, object] = {
        "what": __doc__.split("\n")[0],
        "draws": draws,
        "auroc": full,
        "auroc_se": {m: float(v.std()) for m, v in b.items()},
        "valla_minus": {
            m: {
                "diff": full["valla"] - full[m],
                "se": float((b["valla"] - b[m]).std()),
                "valla_ahead_fraction": float(((b["valla"] - b[m]) > 0).double().mean()),
            }
            for m in b
            if m != "valla"
        },
        "load_avg_start": load0,
        "load_avg_end": os.getloadavg(),
        "runtime_s": time.perf_counter() - start,
    }
    with open("benchmarks/results/valla_ood_bootstrap.json", "w") as fh:
        json.dump(out, fh, indent=1)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    import argparse

    from gaussify.cli_args import add_device_argument

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--draws", type=int, default=2000)
    add_device_argument(parser)
    args = parser.parse_args()
    if args.device.type != "cpu":
        parser.error(f"--device {args.device}: the experiment's data and fits run on the host")
    main(args.draws)
