"""Issue 19: VaLLA's validation NLL after its first step, against its first epoch's (images).

Would scoring the validation NLL at iteration 0 (the authors' ``fit``) change where VaLLA's
early stopping ends on the image data sets?
The authors' ``utils/pytorch_learning.fit`` scores the validation NLL when ``i % val_steps == 0``
(after the first step, then once per epoch) and returns at the first score above the previous
one. Our rule (``function_space_images.VALLA_EARLY_STOPPING``) scores at the end of each epoch
only. The first-step score can change the stop only if it is below the first epoch's score
(then the authors' rule stops after one epoch). For each data set of the experiment (its
network, MAP and VaLLA settings), this records the validation NLL of the initial q(u) (before
any step) and after the first step (a fit with ``max_steps=1``: the cosine schedule's factor is 1
at the first step whatever the budget, so that step is the full run's first step). Writes
``benchmarks/results/valla_stopping_rule.json`` with, beside them, the first epoch's score of the
full run (``val_nll_history[0]`` of the VaLLA record in ``experiments_function_space_images.json``)
and whether the first-step score is below it (only then would the authors' rule stop earlier).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import gaussify as gs
from gaussify.cli_args import add_device_argument
from gaussify.experiments import function_space_images as fi
from gaussify.experiments._runner import train_map_eval


def main() -> None:
    torch.set_num_threads(1)
    load0, start = os.getloadavg(), time.perf_counter()
    with open("benchmarks/results/experiments_function_space_images.json") as fh:
        images = json.load(fh)
    cfg = images["config"]
    records = {r["dataset"]: r for r in images["records"] if r["method"] == "valla"}
    out: dict[str, object] = {"what": __doc__.split("\n")[0]}
    for name in fi.DATASETS:
        ds = fi._load(name, cfg)
        x, y, val = ds.x_train, ds.y_train, (ds.x_val, ds.y_val)
        model = fi.make_mlp(x.shape[1], cfg["width"], 10, cfg["seed"])
        train_map_eval(model, (x, y), "classification", cfg, batch_size=128)

        def valla(model=model, **kw):
            return gs.VaLLA(
                model, "classification", num_inducing=cfg["num_inducing"],
                epochs=cfg["valla_epochs"], batch_size=128, kernel="ntk", seed=cfg["seed"], **kw,
            )  # fmt: skip

        initial = valla().initialize((x, y)).validation_nll(val)
        first = valla(max_steps=1).fit((x, y), val).history["val_nll"][0]
        epoch = records[name]["val_nll_history"][0]
        out[name] = {
            "val_nll_initial": initial,
            "val_nll_after_first_step": first,
            "val_nll_first_epoch": epoch,
            "iteration0_score_changes_the_stop": first < epoch,
        }
        print(name, out[name], flush=True)
    out.update(load_avg_start=load0, load_avg_end=os.getloadavg())
    out["runtime_s"] = time.perf_counter() - start
    with open("benchmarks/results/valla_stopping_rule.json", "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_device_argument(parser)
    if parser.parse_args().device.type != "cpu":
        parser.error("--device: the experiment's data and fits run on the host")
    main()
