"""Issue 19: VaLLA on fashion_mnist (the function_space_images setting, M = 200 inducing pairs) with
the prior precision fixed (argv[1]) instead of learned, to isolate its effect on OOD-AUROC.

    python benchmarks/valla_ood_prior.py --prior 6.309573444801932 --output out.json
"""

import argparse
from pathlib import Path

import gaussify as gs
from gaussify.cli_args import add_device_argument
from gaussify.experiments import function_space_images as img
from gaussify.experiments._report import write_json

parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
parser.add_argument("--prior", type=float, required=True)
parser.add_argument("--output", type=Path, required=True)
add_device_argument(parser)
args = parser.parse_args()
if args.device.type != "cpu":
    parser.error(f"--device {args.device}: the experiment runs on the host")
prior, out = args.prior, args.output
orig = img._fit


def fit(method, model, train, val, cfg):
    if method != "valla":
        return orig(method, model, train, val, cfg)
    x, y = train
    return gs.VaLLA(
        model,
        "classification",
        num_inducing=cfg["num_inducing"],
        epochs=cfg["valla_epochs"],
        batch_size=128,
        kernel="ntk",
        seed=cfg["seed"],
        prior_precision=prior,
        learn_prior=False,
    ).fit((x, y), val, **img.VALLA_EARLY_STOPPING)


img._fit = fit
res = img.run(datasets=["fashion_mnist"], methods=["map", "valla"], num_inducing=200, angles=[0.0])
write_json(Path(out), res.to_dict())
print(res.table())
