"""Every posterior family fits and predicts with its tensors on the model's device (issue 17).

Each case builds the same small float64 problem, runs fit (+ tuning where the family has it)
and predict once on the CPU (the reference) and once on the ``device`` fixture's device
(CPU, and CUDA where a GPU is present), then checks that every output lives on that device
and equals the CPU float64 result (draws come from host generators, so samples agree too).
On a CPU-only machine the CUDA cases skip; ``tests/test_device_rules.py`` catches device
bugs statically there.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import gaussify as gs
from gaussify import last_layer

DT = torch.float64
N, D, H, C = 24, 3, 6, 2


def _problem(task: str) -> tuple[nn.Module, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, C if task != "reg" else 1))
    model = model.to(DT)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=DT) / 2)
    x = torch.randn(N, D, generator=gen, dtype=DT)
    if task == "reg":
        y = x.sum(1, keepdim=True).sin() + 0.1 * torch.randn(N, 1, generator=gen, dtype=DT)
    else:
        y = (x[:, 0] > 0).long()
    return model, x, y


def _outputs(pred: gs.Predictive) -> dict[str, Tensor]:
    names = ("f_mean", "f_cov", "probs", "noise_var", "f_samples")
    return {n: getattr(pred, n) for n in names if getattr(pred, n, None) is not None}


def _laplace(structure: str, subset: str = "all", task: str = "clf") -> Callable:
    def run(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        lik = "regression" if task == "reg" else "classification"
        la = gs.Laplace(model, lik, structure, subset=subset).fit((x, y))
        la.optimize_prior()
        out = _outputs(la.predict(x))
        out["prior_precision"] = la.prior_precision
        out["sigma_noise"] = la.sigma_noise
        out["log_evidence"] = la.log_marginal_likelihood()
        return out

    return run


def _functional(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    return _outputs(gs.FunctionalLaplace(model, "classification").fit((x, y)).predict(x))


def _ella(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    return _outputs(gs.ELLA(model, "classification", num_landmarks=8).fit((x, y)).predict(x))


def _sampled(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    post = gs.SampledLLA(model, "classification", num_samples=4, solver="solve")
    return _outputs(post.fit((x, y)).predict(x))


def _valla(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    post = gs.VaLLA(model, "classification", num_inducing=4, epochs=1, batch_size=12)
    return _outputs(post.fit((x, y)).predict(x))


def _ngvi(cls: type, structure: str) -> Callable:
    def run(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        post = cls(model, "classification", structure=structure, num_data=N)
        post.fit((x, y), epochs=1, batch_size=12, shuffle=False, monitor=False)
        out = _outputs(post.predict(x))
        out["mean"] = post.mean
        return out

    return run


def _vbll(make: Callable[[], nn.Module], task: str) -> Callable:
    """One training step of a VBLL head on fixed features, then its predictive."""

    def run(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        torch.manual_seed(0)
        head = make().to(dtype=DT)
        device = next(model.parameters()).device
        head = head.to(device)
        phi = model[:2](x)
        target = y.to(DT) if task == "reg" else y
        loss = head(phi).train_loss_fn(target)
        loss.backward()
        out = {"loss": loss.detach()}
        out.update({f"grad:{n}": p.grad for n, p in head.named_parameters()})
        pred = head(phi.detach()).predictive
        if task == "reg":
            out["mean"], out["var"] = pred.mean, pred.var
        else:
            out["probs"] = pred.probs
        return out

    return run


CASES: dict[str, tuple[str, Callable]] = {
    "laplace-full": ("clf", _laplace("full")),
    "laplace-full-regression": ("reg", _laplace("full", task="reg")),
    "laplace-kron": ("clf", _laplace("kron")),
    "laplace-diag": ("clf", _laplace("diag")),
    "laplace-lowrank": ("clf", _laplace("lowrank")),
    "laplace-last-layer": ("clf", _laplace("kron", subset="last_layer")),
    "functional-laplace": ("clf", _functional),
    "ella": ("clf", _ella),
    "sampled-lla": ("clf", _sampled),
    "valla": ("clf", _valla),
    "voggn": ("clf", _ngvi(gs.VOGGN, "diag")),
    "oggn": ("clf", _ngvi(gs.OGGN, "full")),
    "vbll-regression": ("reg", _vbll(lambda: last_layer.VBLLRegression(H, 1, 1 / N), "reg")),
    "vbll-discriminative": (
        "clf",
        # the probit link: the MC link's unseeded draws come from each device's own stream
        # (CUDA's differs from the CPU's), so only a deterministic link can be compared
        _vbll(lambda: last_layer.VBLLDiscriminative(H, C, 1 / N, link="probit"), "clf"),
    ),
    "vbll-generative": ("clf", _vbll(lambda: last_layer.VBLLGenerative(H, C, 1 / N), "clf")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fit_and_predict_on_the_model_device(case: str, device: str) -> None:
    task, run = CASES[case]
    model, x, y = _problem(task)
    # the same global random state for both runs: lowrank's Lanczos start vector (and any other
    # unseeded draw) comes from it, and where the GGN's rank is below the requested rank the
    # null-space part of the top-k eigenvectors depends on that start
    torch.manual_seed(0)
    reference = run(copy.deepcopy(model), x, y)
    torch.manual_seed(0)
    got = run(copy.deepcopy(model).to(device), x.to(device), y.to(device))
    assert got.keys() == reference.keys()
    for name, value in got.items():
        assert value.device.type == torch.device(device).type, f"{case}: {name} on {value.device}"
        torch.testing.assert_close(
            value.cpu(), reference[name], rtol=1e-8, atol=1e-10, msg=f"{case}: {name}"
        )


def _exact(device: str) -> Callable:
    def run(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        phi = model[:2](x).detach()
        layer = last_layer.ExactLastLayer(H, C, device=phi.device).fit((phi, y))
        pred = layer.predict(phi, link="mc", generator=torch.Generator().manual_seed(0))
        return {**_outputs(pred), "evidence": layer.log_marginal_likelihood()}

    return run


def test_exact_last_layer_on_the_device(device: str) -> None:
    model, x, y = _problem("clf")
    reference = _exact("cpu")(copy.deepcopy(model), x, y)
    got = _exact(device)(copy.deepcopy(model).to(device), x.to(device), y.to(device))
    for name, value in got.items():
        assert value.device.type == torch.device(device).type, name
        torch.testing.assert_close(value.cpu(), reference[name], rtol=1e-8, atol=1e-10)


def test_exact_last_layer_refuses_features_elsewhere() -> None:
    layer = last_layer.ExactLastLayer(H, C, device="meta")
    with pytest.raises(ValueError, match=r"phi: is on cpu, the layer's posterior is on meta"):
        layer.update(torch.zeros(2, H, dtype=DT), torch.tensor([0, 1]))
