"""GP classification (Bui, Sec. 4.2): gaussify's exact heteroscedastic GP vs gpytorch's exact GP
with ``DirichletClassificationLikelihood`` on the same data and hyperparameters.

For each N (satellite, 6 classes, float64, one thread): the time of one log marginal
likelihood + gradient and of the latent predictive on 500 test points (median of 3), and the
largest differences in LML and predictive mean / variance. gpytorch runs twice: with Cholesky
forced (``max_cholesky_size``) and with its defaults (CG / Lanczos above 800 points). Also the
L-BFGS fit time of ours for every method of :class:`GPClassifier` (``moment-ori``, ``moment``,
``laplace``, ``variational``, ``gauss``), after one untimed warm-up fit, and per L-BFGS
evaluation.

:func:`gpytorch_dirichlet_gp` (gpytorch's model at our hyperparameters) is also the reference
of ``tests/test_gp_classification.py``.

    python benchmarks/gp_classification.py [--sizes 250 500 1000] [--methods ...]
"""

# ruff: noqa: B023  (the timing closures are called only within their loop iteration)
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import gaussify as gs
from gaussify.approx_likelihoods import GPClassifier
from gaussify.approx_likelihoods.pseudo_targets import SUPPORTED_BASES
from gaussify.cli_args import add_device_argument

DT = torch.float64
#: every method GPClassifier supports in the log basis (all five)
METHODS: list[str] = [m for m, bases in SUPPORTED_BASES.items() if "log" in bases]


def _median_time(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gpytorch_dirichlet_gp(gpytorch, x: torch.Tensor, y: torch.Tensor, gp: GPClassifier):
    """gpytorch's exact GP with ``DirichletClassificationLikelihood`` (batch of one GP per
    class, constant mean, scaled RBF kernel) at the hyperparameters of a fitted ``moment-ori``
    ``gp``, in float64. Returns ``(model, likelihood)``."""
    likelihood = gpytorch.likelihoods.DirichletClassificationLikelihood(
        y, alpha_epsilon=gp.likelihood.alpha_eps, learn_additional_noise=False, dtype=DT
    )
    c = likelihood.num_classes
    batch = torch.Size((c,))

    class Model(gpytorch.models.ExactGP):
        def __init__(self) -> None:
            super().__init__(x, likelihood.transformed_targets, likelihood)
            self.mean_module = gpytorch.means.ConstantMean(batch_shape=batch)
            self.covar_module = gpytorch.kernels.ScaleKernel(
                gpytorch.kernels.RBFKernel(batch_shape=batch), batch_shape=batch
            )

        def forward(self, inputs):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(inputs), self.covar_module(inputs)
            )

    model = Model().to(DT)
    model.mean_module.constant.data = gp.mean.clone()
    model.covar_module.base_kernel.lengthscale = gp.lengthscale.reshape(c, 1, 1)
    model.covar_module.outputscale = gp.variance.clone()
    return model, likelihood


def bench(n: int, methods: list[str]) -> dict:
    import gpytorch

    ds = gs.data.load("satellite", seed=0, max_train=n, dtype=DT)
    x, y, xt = ds.x_train, ds.y_train, ds.x_test[:500]
    row: dict = {"n": int(x.shape[0]), "classes": 6, "fit_s": {}, "evaluations": {}}
    GPClassifier("moment-ori", 0.03).fit(x, y, 6, max_iter=2)  # warm-up, not timed
    for method in methods:
        gp = GPClassifier(method, 0.03 if method == "moment-ori" else 0.1)
        start = time.perf_counter()
        res = gp.fit(x, y, 6)
        row["fit_s"][method] = time.perf_counter() - start
        row["evaluations"][method] = res.evaluations
    # L-BFGS runs to its own stopping rule, so the methods differ mostly in evaluation counts
    row["fit_s_per_evaluation"] = {m: row["fit_s"][m] / row["evaluations"][m] for m in methods}
    gp = GPClassifier("moment-ori", 0.03)
    gp.fit(x, y, 6, max_iter=20)
    ls = gp.log_lengthscale.clone().requires_grad_(True)
    lv = gp.log_variance.clone().requires_grad_(True)

    def ours_lml() -> None:
        gp.log_marginal_likelihood(ls, lv).backward()

    row["ours_lml_grad_s"] = _median_time(ours_lml)
    row["ours_predict_s"] = _median_time(lambda: gp.predict_latent(xt))
    ours = gp.log_marginal_likelihood(per_class=True).detach()
    mu, var = gp.predict_latent(xt)
    for label, size in (("gpytorch_cholesky", 10**7), ("gpytorch_default", None)):
        model, likelihood = gpytorch_dirichlet_gp(gpytorch, x, y, gp)
        mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)

        def ctx():
            if size:
                return gpytorch.settings.max_cholesky_size(size)
            return gpytorch.settings.debug(False)

        def theirs_lml() -> torch.Tensor:
            model.train()
            likelihood.train()
            with ctx():
                out = mll(model(x), likelihood.transformed_targets) * x.shape[0]
            return out

        def step() -> None:
            model.zero_grad()
            theirs_lml().sum().backward()

        row[f"{label}_lml_grad_s"] = _median_time(step)
        val = theirs_lml().detach()

        def predict() -> torch.Tensor:
            model.eval()
            likelihood.eval()
            with torch.no_grad(), ctx():
                return model(xt)

        row[f"{label}_predict_s"] = _median_time(predict)
        post = predict()
        row[f"{label}_max_lml_diff"] = float((val - ours).abs().max())
        row[f"{label}_max_mean_diff"] = float((post.mean.T - mu).abs().max())
        row[f"{label}_max_var_diff"] = float((post.variance.T - var).abs().max())
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", type=int, default=[250, 500, 1000])
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument(
        "--output", type=Path, default=Path("benchmarks/results/gp_classification.json")
    )
    add_device_argument(parser)
    args = parser.parse_args()
    if args.device.type != "cpu":
        # GPClassifier sets its hyperparameters up from sizes and a dtype on the host (no
        # device argument yet; see tests/test_device_rules.py, NODEVICE)
        parser.error(f"--device {args.device}: GPClassifier runs on the CPU only")
    torch.set_num_threads(1)
    rows = []
    for n in args.sizes:
        row = bench(n, args.methods)
        print(json.dumps(row), flush=True)
        rows.append(row)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
