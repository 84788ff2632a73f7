"""Issue 19: rerun the VaLLA rows of ``experiments_function_space_images.json`` and merge them.

For each data set, ``function_space_images.run(datasets=[name], methods=["map", "ella",
"valla"])`` at the committed configuration (one process, 1 thread, ELLA and VaLLA side by side
for their fit times); the new MAP and ELLA records must equal the committed ones in every field
but the timings (same network, same code: bit-identical metrics); the ELLA record takes the new
timings and the VaLLA record replaces the committed one. The run's runtime and load averages
are added to the file's config. ``--base`` takes another file of the experiment (its config
flat, or one per data set as in ``experiments_function_space_images_valla100.json``); only the
methods it holds are rerun.

    python benchmarks/valla_images_rerun.py --datasets mnist fashion_mnist --note "..."
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from gaussify.cli_args import add_device_argument
from gaussify.experiments import function_space_images as fi
from gaussify.experiments._report import write_json

PATH = Path("benchmarks/results/experiments_function_space_images.json")
#: the fields of a record that depend on timing, not on the mathematics
TIMING = ("fit_s", "predict_s")


def same(a: dict, b: dict) -> bool:
    """Every non-timing field of records ``a`` and ``b`` equal (floats bit-identical)."""
    keys = (set(a) | set(b)) - set(TIMING)
    return all(a.get(k) == b.get(k) for k in keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=list(fi.DATASETS))
    parser.add_argument("--note", default="")
    parser.add_argument("--base", type=Path, default=PATH)
    parser.add_argument("--output", type=Path, default=PATH)
    add_device_argument(parser)
    args = parser.parse_args()
    if args.device.type != "cpu":
        parser.error(f"--device {args.device}: the experiment's data and fits run on the host")
    base = json.loads(args.base.read_text())
    runs = []
    for name in args.datasets:
        cfg = base["config"].get(name, base["config"])
        old = {r["method"]: r for r in base["records"] if r["dataset"] == name}
        methods = [m for m in ("map", "ella", "valla") if m in old]
        load0, start = os.getloadavg(), time.perf_counter()
        res = fi.run(
            datasets=[name],
            methods=methods,
            angles=cfg["angles"],
            seed=cfg["seed"],
            max_train=cfg["max_train"],
            max_test=cfg["max_test"],
            width=cfg["width"],
            epochs=cfg["epochs"],
            num_inducing=cfg["num_inducing"],
            ella_landmarks=cfg["ella_landmarks"],
            valla_epochs=cfg["valla_epochs"],
        ).to_dict()
        runtime = time.perf_counter() - start
        new = {r["method"]: r for r in res["records"]}
        for method in set(methods) - {"valla"}:
            if not same(new[method], old[method]):
                raise SystemExit(f"{name}: the {method} record differs from the committed one")
        base["records"] = [
            new[r["method"]] if r["dataset"] == name and r["method"] in ("ella", "valla") else r
            for r in base["records"]
        ]
        runs.append(
            {
                "dataset": name,
                "runtime_s": runtime,
                "load_avg_start": load0,
                "load_avg_end": os.getloadavg(),
            }
        )
        summary = {k: new["valla"][k] for k in ("nll", "ood_auroc", "fit_s", "steps")}
        summary["ella_fit_s"] = new["ella"]["fit_s"] if "ella" in new else None
        print(name, summary, flush=True)
    base["config"]["valla_rerun"] = {
        "note": args.note,
        "early_stopping": dict(fi.VALLA_EARLY_STOPPING),
        "runs": runs,
    }
    base["notes"] = fi._notes(base["records"])
    write_json(args.output, base)


if __name__ == "__main__":
    main()
