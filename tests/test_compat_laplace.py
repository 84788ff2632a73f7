"""gaussify.compat.laplace: laplace-torch user code runs unchanged and gives laplace-torch's
numbers. Each workflow runs twice, against laplace-torch (skipped when it is not installed)
and against the compat layer, in float64; the tests without laplace-torch check the compat
layer against gaussify's own engine and closed forms."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gaussify as gs
from gaussify.compat import laplace as compat

RTOL = 1e-4

try:  # imported at collection, so that its import time is not charged to one test
    import laplace as _laplace_torch

    # its first full-GGN fit pays one-off lazy initialisation (~4 s): pay it at collection
    _warm = nn.Linear(2, 2).double()
    _laplace_torch.Laplace(_warm, "classification", "all", "full").fit(
        DataLoader(TensorDataset(torch.zeros(2, 2).double(), torch.zeros(2).long()))
    )
except ImportError:  # CI does not install laplace-torch: the parity tests skip
    _laplace_torch = None


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    warnings.simplefilter("ignore")
    yield
    torch.set_default_dtype(old)


def _classification():
    torch.manual_seed(0)
    x, y = torch.randn(60, 4), torch.randint(0, 3, (60,))
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    return model, x, y, DataLoader(TensorDataset(x, y), batch_size=20)


def _regression():
    torch.manual_seed(1)
    x = torch.randn(50, 3)
    y = torch.sin(x.sum(1, keepdim=True)) + 0.1 * torch.randn(50, 1)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))
    return model, x, y, DataLoader(TensorDataset(x, y), batch_size=16)


def _original():
    if _laplace_torch is None:
        pytest.skip("laplace-torch is not installed")
    return _laplace_torch


def _close(a, b, rtol=RTOL, atol=1e-10):
    torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- user workflows
# Written as a laplace-torch user would; `lib` is the `laplace` module or gaussify.compat.laplace.


def classification_workflow(lib, subset, structure):
    model, x, _, loader = _classification()
    la = lib.Laplace(
        model,
        "classification",
        subset_of_weights=subset,
        hessian_structure=structure,
        prior_precision=0.5,
    )
    la.fit(loader)
    out = {"lml": la.log_marginal_likelihood().detach(), "n_params": la.n_params}
    out["probit"] = la(x[:7], pred_type="glm", link_approx="probit")
    out["bridge"] = la(x[:7], pred_type="glm", link_approx="bridge")
    out["bridge_norm"] = la(x[:7], pred_type="glm", link_approx="bridge_norm")
    out["logdet"] = la.log_det_posterior_precision.detach()
    out["mean"] = la.mean.detach()
    la.optimize_prior_precision(method="marglik", pred_type="glm", link_approx="probit")
    out["tuned"] = la.prior_precision.detach()
    out["tuned_probs"] = la(x[:7], pred_type="glm", link_approx="probit")
    return out


def regression_readme_workflow(lib, subset, structure, temperature=1.0):
    """laplace-torch README: evidence tuned by Adam on log prior and log noise."""
    model, x, _, loader = _regression()
    la = lib.Laplace(
        model,
        "regression",
        subset_of_weights=subset,
        hessian_structure=structure,
        temperature=temperature,
    )
    la.fit(loader)
    log_prior, log_sigma = torch.ones(1, requires_grad=True), torch.ones(1, requires_grad=True)
    hyper_optimizer = torch.optim.Adam([log_prior, log_sigma], lr=1e-1)
    for _ in range(20):
        hyper_optimizer.zero_grad()
        neg_marglik = -la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())
        neg_marglik.backward()
        hyper_optimizer.step()
    f_mu, f_var = la(x[:5])
    f_mu_j, f_cov_j = la(x[:5], pred_type="glm", joint=True)
    _, f_var_d = la(x[:5], pred_type="glm", diagonal_output=True)
    return {
        "neg_marglik": neg_marglik.detach(),
        "sigma": la.sigma_noise.detach(),
        "prior": la.prior_precision.detach(),
        "f_mu": f_mu,
        "f_var": f_var,
        "f_mu_joint": f_mu_j,
        "f_cov_joint": f_cov_j,
        "f_var_diag": f_var_d,
        "pred_std": (f_var.squeeze() + la.sigma_noise.detach() ** 2).sqrt(),
    }


def _assert_same(ref, ours):
    assert ref.keys() == ours.keys()
    for key in ref:
        _close(ours[key], ref[key])


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_classification_workflow_equals_laplace_torch(subset, structure):
    lt = _original()
    _assert_same(
        classification_workflow(lt, subset, structure),
        classification_workflow(compat, subset, structure),
    )


@pytest.mark.parametrize(
    ("subset", "structure"),
    [("all", "full"), ("all", "diag"), ("last_layer", "full"), ("last_layer", "diag")],
)
def test_regression_readme_workflow_equals_laplace_torch(subset, structure):
    lt = _original()
    _assert_same(
        regression_readme_workflow(lt, subset, structure, temperature=0.7),
        regression_readme_workflow(compat, subset, structure, temperature=0.7),
    )


def test_kron_noise_gradient_is_exact_where_laplace_torch_is_not():
    """laplace-torch's Kronecker evidence has the right value but a wrong derivative in
    sigma_noise (listed in docs/migrating.md); ours matches central finite differences."""
    model, _, _, loader = _regression()
    la = compat.Laplace(model, "regression", "all", "kron")
    la.fit(loader)
    log_prior = torch.tensor([0.3], requires_grad=True)
    log_sigma = torch.tensor([0.2], requires_grad=True)
    la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp()).backward()

    def value(a: float, b: float) -> float:
        with torch.no_grad():
            prior, sigma = torch.tensor([a]).exp(), torch.tensor([b]).exp()
            return float(la.log_marginal_likelihood(prior, sigma))

    eps = 1e-6
    fd_sigma = (value(0.3, 0.2 + eps) - value(0.3, 0.2 - eps)) / (2 * eps)
    fd_prior = (value(0.3 + eps, 0.2) - value(0.3 - eps, 0.2)) / (2 * eps)
    _close(log_sigma.grad[0], fd_sigma, rtol=1e-6)
    _close(log_prior.grad[0], fd_prior, rtol=1e-6)
    ref = _original().Laplace(model, "regression", "all", "kron")
    ref.fit(loader)
    for p in (0.3, 1.0):
        for s in (0.2, -0.5):
            prior, sigma = torch.tensor([p]).exp(), torch.tensor([s]).exp()
            _close(
                la.log_marginal_likelihood(prior, sigma), ref.log_marginal_likelihood(prior, sigma)
            )


def test_prior_structures_and_gridsearch_equal_laplace_torch():
    lt = _original()
    model, x, y, loader = _classification()
    val = DataLoader(TensorDataset(x[:30], y[:30]), batch_size=10)
    out = []
    for lib in (lt, compat):
        la = lib.Laplace(model, "classification", "all", "diag")
        la.fit(loader)
        la.optimize_prior_precision(method="marglik", prior_structure="layerwise", n_steps=30)
        layer = la.prior_precision.clone()
        la.optimize_prior_precision(method="marglik", prior_structure="diag", n_steps=30)
        diag = la.prior_precision.clone()
        la.optimize_prior_precision(method="gridsearch", val_loader=val, grid_size=15)
        out.append((layer, diag, la.prior_precision.clone()))
    for ref, ours in zip(*out, strict=True):
        _close(ours, ref)


def test_subnetwork_and_state_dict_equal_laplace_torch():
    lt = _original()
    model, x, _, loader = _classification()
    idx = torch.tensor([0, 3, 7, 20, 31, 40, 45, 50])
    out = []
    for lib in (lt, compat):
        la = lib.Laplace(model, "classification", "subnetwork", "full", subnetwork_indices=idx)
        la.fit(loader)
        la2 = lib.Laplace(model, "classification", "subnetwork", "full", subnetwork_indices=idx)
        la2.load_state_dict(la.state_dict())
        out.append(
            (
                la.log_marginal_likelihood().detach(),
                la2(x[:5], link_approx="probit"),
                la2.posterior_covariance,
                la.sample(4).shape,
            )
        )
    for ref, ours in zip(*out, strict=True):
        _close(
            torch.as_tensor(ours, dtype=torch.float64), torch.as_tensor(ref, dtype=torch.float64)
        )


# ------------------------------------------------------------------------ without laplace-torch


@pytest.mark.parametrize("structure", ["full", "kron", "diag", "lowrank"])
def test_compat_equals_engine_with_laplace_torch_conventions(structure):
    model, x, _, loader = _classification()
    la = compat.Laplace(model, "classification", "all", structure, prior_precision=0.7)
    la.fit(loader)
    options = {"kron_bias": "separate"} if structure == "kron" else {}
    ref = gs.Laplace(
        model, "classification", structure, "all", prior_precision=0.7, correction=False, **options
    ).fit(loader)
    _close(la.log_marginal_likelihood(), ref.log_marginal_likelihood(), rtol=1e-12)
    pred = ref.predict(x[:6], "glm")
    kappa = 1 / torch.sqrt(1 + math.pi / 8 * pred.f_var)
    _close(la(x[:6], link_approx="probit"), torch.softmax(kappa * pred.f_mean, -1), rtol=1e-12)
    assert la.prior_precision.shape == (1,)
    assert la.n_params == ref.subset.num_params and la.n_layers == 4


def test_evidence_is_laplace_torch_formula_from_dense_posterior():
    """log p(D) = log lik - 1/2 (log det P - log det P0 + theta^T P0 theta), T-untempered
    Gaussian normaliser, checked against a dense float64 oracle."""
    model, _, y, loader = _regression()
    la = compat.Laplace(model, "regression", "all", "full", sigma_noise=0.5, temperature=2.0)
    la.fit(loader)
    theta = la.mean
    prec = la.posterior_precision
    with torch.no_grad():
        x = torch.cat([b[0] for b in loader])
        sse = (model(x) - y).square().sum()
    n = y.numel()
    log_lik = -sse / (2 * 0.25 * 2.0) - n * math.log(0.5 * math.sqrt(2 * math.pi))
    expected = log_lik - 0.5 * (torch.logdet(prec) - theta.numel() * math.log(1.0) + theta @ theta)
    _close(la.log_marginal_likelihood(), expected, rtol=1e-10)
    _close(la.log_likelihood, log_lik, rtol=1e-10)
    # posterior precision is G / (sigma^2 T) + P0 with the GGN G = sum J^T J
    jac = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (x,)))(
        dict(model.named_parameters())
    )
    j = torch.cat([v.reshape(n, -1) for v in jac.values()], 1)
    _close(prec, j.T @ j / (0.25 * 2.0) + torch.eye(theta.numel()), rtol=1e-10)
    _close(la.H, j.T @ j, rtol=1e-8, atol=1e-8)


def test_bridge_link_closed_form():
    """Laplace bridge after the zero-sum projection, on a hand-made Gaussian."""
    from gaussify.compat.laplace.links import apply_link

    mu = torch.tensor([[0.5, -1.0, 2.0]])
    cov = torch.tensor([[[1.0, 0.2, 0.0], [0.2, 2.0, 0.1], [0.0, 0.1, 0.5]]])
    row = cov.sum(-1)
    mu_p = mu - row * mu.sum() / row.sum()
    cov_p = cov - row[:, :, None] * row[:, None, :] / row.sum()
    var = cov_p.diagonal(dim1=1, dim2=2)
    k = 3
    alpha = (1 - 2 / k + mu_p.exp() * (-mu_p).exp().sum() / k**2) / var
    _close(apply_link(mu, cov, "bridge"), alpha / alpha.sum(), rtol=1e-12)
    probs = apply_link(mu, cov, "mc", n_samples=20000, generator=torch.Generator().manual_seed(0))
    _close(probs.sum(), torch.tensor(1.0), rtol=1e-12)


def test_nn_predictive_and_samples_shapes_and_moments():
    model, x, _, loader = _regression()
    la = compat.Laplace(model, "regression", "last_layer", "full", prior_precision=2.0)
    la.fit(loader)
    gen = torch.Generator().manual_seed(0)
    mean, var = la(x[:4], pred_type="nn", link_approx="mc", n_samples=4000, generator=gen)
    f_mu, f_var = la(x[:4])
    # the last layer is linear in its weights: NN sampling and GLM agree up to MC error
    _close(mean, f_mu, rtol=0, atol=5 * float(f_var.max().sqrt()) / math.sqrt(4000) * 3)
    _close(var, f_var[..., 0], rtol=0.15)
    assert la.sample(5).shape == (5, 6)
    assert la.predictive_samples(x[:4], n_samples=3).shape == (3, 4, 1)
    assert la.functional_samples(x[:4], pred_type="nn", n_samples=3).shape == (3, 4, 1)


def test_factory_and_argument_errors():
    model, _, _, loader = _classification()
    with pytest.raises(ValueError, match="hessian_structure: subnetwork Laplace needs"):
        compat.Laplace(model, "classification", "subnetwork", "kron")
    with pytest.raises(ValueError, match="subset_of_weights: expected one of"):
        compat.Laplace(model, "classification", "some", "kron")
    with pytest.raises(ValueError, match="sigma_noise: must be 1 for classification"):
        compat.Laplace(model, "classification", sigma_noise=2.0)
    la = compat.Laplace(model, "classification", "all", "kron")
    with pytest.raises(ValueError, match=r"prior_precision: expected length in \[1, 4\]"):
        la.prior_precision = torch.ones(la.n_params)
    with pytest.raises(AttributeError, match="Run fit"):
        la(torch.zeros(1, 4))
    la.fit(loader)
    with pytest.raises(ValueError, match="link_approx: only 'mc'"):
        la(torch.zeros(1, 4), pred_type="nn", link_approx="probit")
    with pytest.raises(ValueError, match="val_loader: method='gridsearch' needs"):
        la.optimize_prior_precision(method="gridsearch")
    with pytest.raises(ValueError, match="state_dict: saved from 'KronLaplace'"):
        compat.Laplace(model, "classification", "all", "diag").load_state_dict(la.state_dict())
    assert isinstance(la, compat.KronLaplace)
    assert type(compat.Laplace(model, "classification")) is compat.KronLLLaplace


# ------------------------------------------------------------------------ function space


@pytest.mark.parametrize("n_subset", [50, 30])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_functional_regression_predictive_equals_laplace_torch(subset, n_subset):
    """Same subset of data (laplace-torch's sampler) and prior convention (n_subset / N)."""
    lt = _original()
    model, x, _, loader = _regression()
    out = []
    for lib in (lt, compat):
        la = lib.Laplace(
            model,
            "regression",
            subset,
            "gp",
            n_subset=n_subset,
            sigma_noise=0.3,
            prior_precision=2.0,
        )
        la.fit(loader)
        out.append(la(x[:6]))
    for ref, ours in zip(*out, strict=True):
        _close(ours, ref, rtol=1e-8)


@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_functional_is_exact_where_laplace_torch_is_not(subset):
    """Multi-class: the full C x C likelihood Hessian, so the GP predictive and evidence equal
    the weight-space full-GGN ones (laplace-torch keeps only the Hessian's diagonal)."""
    model, x, _, loader = _classification()
    la = compat.Laplace(model, "classification", subset, "gp", n_subset=60, prior_precision=0.5)
    la.fit(loader)
    ref = gs.Laplace(model, "classification", "full", subset, prior_precision=0.5).fit(loader)
    pred = ref.predict(x[:5])
    _close(la._moments(x[:5], False)[1], pred.f_cov, rtol=1e-8)
    kappa = 1 / torch.sqrt(1 + math.pi / 8 * pred.f_var)
    _close(la(x[:5]), torch.softmax(kappa * pred.f_mean, -1), rtol=1e-8)
    _close(la.log_marginal_likelihood(), ref.log_marginal_likelihood(), rtol=1e-8)
    if _laplace_torch is not None:  # and laplace-torch's variance is not that one
        lt_la = _laplace_torch.Laplace(
            model, "classification", subset, "gp", n_subset=60, prior_precision=0.5
        )
        lt_la.fit(loader)
        lt_var = lt_la._glm_predictive_distribution(x[:5])[1]
        assert (lt_var - pred.f_cov).abs().max() > 0.1


def test_functional_regression_evidence_equals_weight_space_full():
    model, _, _, loader = _regression()
    la = compat.Laplace(model, "regression", "all", "gp", n_subset=50, sigma_noise=0.3)
    la.fit(loader)
    ref = gs.Laplace(model, "regression", "full", "all", sigma_noise=0.3).fit(loader)
    _close(la.log_marginal_likelihood(), ref.log_marginal_likelihood(), rtol=1e-8)
    with pytest.raises(ValueError, match="prior_precision: FunctionalLaplace supports only"):
        la.prior_precision = torch.ones(3)


# ------------------------------------------------------------------------ marglik training


def marglik_workflow(lib, likelihood, structure):
    torch.manual_seed(0)
    x = torch.randn(40, 3)
    regression = likelihood == "regression"
    y = torch.sin(x.sum(1, keepdim=True)) if regression else (x[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1 if regression else 2))
    loader = DataLoader(TensorDataset(x, y), batch_size=10)
    la, model, margliks, losses = lib.marglik_training(
        model,
        loader,
        likelihood,
        structure,
        n_epochs=6,
        n_hypersteps=5,
        marglik_frequency=2,
        optimizer_kwargs={"lr": 1e-2},
    )
    return {
        "margliks": torch.tensor(margliks),
        "losses": torch.tensor(losses),
        "prior": la.prior_precision,
        "sigma": la.sigma_noise,
        "lml": la.log_marginal_likelihood().detach(),
        "weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
    }


@pytest.mark.parametrize(
    ("likelihood", "structure"),
    [("regression", "full"), ("regression", "diag"), ("classification", "kron")],
)
def test_marglik_training_equals_laplace_torch(likelihood, structure):
    lt = _original()
    _assert_same(
        marglik_workflow(lt, likelihood, structure),
        marglik_workflow(compat, likelihood, structure),
    )


def test_marglik_training_returns_the_best_evidence_refit():
    """The returned Laplace is refitted at the best epoch's weights with the hyperparameters of
    that epoch's last evidence evaluation, so its evidence is the best recorded one."""
    out = marglik_workflow(compat, "regression", "full")
    ends = out["margliks"].reshape(-1, 5)[:, -1]  # the last hyperstep of each update
    _close(out["lml"], -ends.min(), rtol=1e-10)
    assert out["losses"].shape == (6,) and out["prior"].shape == (4,)


# ------------------------------------------------------------------------ scripts, import changed

SCRIPT = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from laplace import Laplace, DiagLaplace
from laplace.curvature import BackPackGGN, CurvlinopsEF
from laplace.utils import LargestMagnitudeSubnetMask, LargestVarianceDiagLaplaceSubnetMask
from laplace.utils import ModuleNameSubnetMask, RandomSubnetMask

torch.manual_seed(0)
x, y = torch.randn(60, 4), torch.randint(0, 3, (60,))
model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
train_loader = DataLoader(TensorDataset(x, y), batch_size=20)
val_loader = DataLoader(TensorDataset(x[:30], y[:30]), batch_size=10)
out = {}

# README: diag over all weights, grid search on a validation set, probit predictive
la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="diag")
la.fit(train_loader)
la.optimize_prior_precision(
    method="gridsearch", pred_type="glm", link_approx="probit", val_loader=val_loader,
    grid_size=12,
)
out["readme"] = la(x[:5], pred_type="glm", link_approx="probit")
out["readme_prior"] = la.prior_precision

# empirical Fisher by its backend, kron last layer, marglik
la = Laplace(model, "classification", "last_layer", "kron", backend=CurvlinopsEF)
la.fit(train_loader)
la.optimize_prior_precision(method="marglik", pred_type="glm", link_approx="probit")
out["ef"] = la(x[:5], link_approx="probit")
out["ef_prior"] = la.prior_precision

# subnetworks
indices = {
    "magnitude": LargestMagnitudeSubnetMask(model, n_params_subnet=10).select(),
    "module": ModuleNameSubnetMask(model, ["2"]).select(train_loader),
}
torch.manual_seed(3)
indices["random"] = RandomSubnetMask(model, n_params_subnet=7).select()
diag = DiagLaplace(model, "classification", prior_precision=2.0)
indices["variance"] = LargestVarianceDiagLaplaceSubnetMask(model, 9, diag).select(train_loader)
for key, idx in indices.items():
    out["idx_" + key] = idx
la = Laplace(model, "classification", subset_of_weights="subnetwork",
             hessian_structure="full", subnetwork_indices=indices["variance"],
             backend=BackPackGGN)
la.fit(train_loader)
out["subnet"] = la(x[:5], link_approx="bridge_norm")
out["subnet_lml"] = la.log_marginal_likelihood().detach()
"""


def _run_script(text):
    namespace: dict = {}
    exec(compile(text, "<migrated script>", "exec"), namespace)
    return namespace["out"]


def _migrated(text):
    return text.replace("from laplace", "from gaussify.compat.laplace")


def test_script_with_only_the_import_changed_equals_laplace_torch():
    _original()
    ref, ours = _run_script(SCRIPT), _run_script(_migrated(SCRIPT))
    assert ref.keys() == ours.keys()
    for key in ref:
        _close(torch.as_tensor(ours[key]).double(), torch.as_tensor(ref[key]).double())


def test_migrated_script_runs_without_laplace_torch():
    out = _run_script(_migrated(SCRIPT))
    assert out["idx_module"].tolist() == list(range(30, 51))  # the last Linear: 18 + 3 weights
    assert len(out["idx_variance"]) == 9 and out["subnet"].shape == (5, 3)
    _close(out["readme"].sum(-1), torch.ones(5), rtol=1e-12)


def test_tuning_after_the_readme_adam_loop_works():
    """laplace-torch keeps the autograd graph of sigma_noise after the README loop, so a later
    optimize_prior_precision raises 'backward through the graph a second time'; here the
    engine sees detached values, and the result equals tuning with the noise set by hand."""
    model, x, _, loader = _regression()
    la = compat.Laplace(model, "regression", "all", "full")
    la.fit(loader)
    log_prior, log_sigma = torch.ones(1, requires_grad=True), torch.ones(1, requires_grad=True)
    opt = torch.optim.Adam([log_prior, log_sigma], lr=1e-1)
    for _ in range(5):
        opt.zero_grad()
        (-la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())).backward()
        opt.step()
    assert la.sigma_noise.requires_grad  # laplace-torch's behaviour: the last value, graph kept
    sigma = float(la.sigma_noise)
    la.optimize_prior_precision(method="marglik", n_steps=20)
    ref = compat.Laplace(model, "regression", "all", "full", sigma_noise=sigma)
    ref.fit(loader)
    ref.optimize_prior_precision(method="marglik", n_steps=20)
    _close(la.prior_precision, ref.prior_precision, rtol=1e-10)
    _close(la(x[:3])[1], ref(x[:3])[1], rtol=1e-10)


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
def test_incremental_fit_and_loss_equal_laplace_torch(structure):
    """fit(override=False) on a second loader adds to the first fit (laplace-torch's online
    Laplace), and the summed training loss ``la.loss`` is laplace-torch's."""
    lt = _original()
    model, x, y, _ = _classification()
    first = DataLoader(TensorDataset(x[:20], y[:20]), batch_size=10)
    second = DataLoader(TensorDataset(x[20:], y[20:]), batch_size=10)
    out = []
    for lib in (lt, compat):
        la = lib.Laplace(model, "classification", "all", structure, temperature=0.5)
        la.fit(first)
        la.fit(second, override=False)
        out.append((la.log_marginal_likelihood().detach(), la(x[:4]), la.n_data, la.loss))
    for ref, ours in zip(*out, strict=True):
        _close(torch.as_tensor(ours).double(), torch.as_tensor(ref).double())
    model, _, _, loader = _regression()
    losses = []
    for lib in (lt, compat):
        la = lib.Laplace(model, "regression", "all", structure, sigma_noise=0.4, temperature=2.0)
        la.fit(loader)
        losses.append(torch.as_tensor(la.loss).double())
    _close(losses[1], losses[0])


@pytest.mark.parametrize(("subset", "structure"), [("all", "kron"), ("last_layer", "full")])
def test_multioutput_regression_input_gradients_equal_laplace_torch(subset, structure):
    """Two outputs, ``enable_backprop=True``: predictive moments and their gradient in x."""
    lt = _original()
    torch.manual_seed(0)
    x, y = torch.randn(40, 3), torch.randn(40, 2)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    loader = DataLoader(TensorDataset(x, y), batch_size=10)
    out = []
    for lib in (lt, compat):
        la = lib.Laplace(
            model, "regression", subset, structure, sigma_noise=0.7, enable_backprop=True
        )
        la.fit(loader)
        xs = x[:3].clone().requires_grad_()
        mean, cov = la(xs)
        (mean.sum() + cov.sum()).backward()
        out.append((mean.detach(), cov.detach(), xs.grad, la.log_marginal_likelihood().detach()))
    for ref, ours in zip(*out, strict=True):
        _close(ours, ref)


@pytest.mark.parametrize("structure", ["full", "diag", "kron"])
def test_posterior_attributes_equal_laplace_torch(structure):
    """H, posterior_precision / _scale / _variance, log_prob and square_norm."""
    lt = _original()
    model, _, _, loader = _classification()
    out = []
    for lib in (lt, compat):
        la = lib.Laplace(model, "classification", "all", structure, prior_precision=0.3)
        la.fit(loader)
        value = la.mean + 0.1 * torch.linspace(-1, 1, la.n_params)
        prec = la.posterior_precision
        attrs = {
            "precision": prec.to_matrix() if structure == "kron" else prec,
            "log_prob": la.log_prob(value),
            "log_prob_unnormalized": la.log_prob(value, normalized=False),
            "prior_diag": la.prior_precision_diag,
            "log_det_ratio": la.log_det_ratio,
        }
        if structure != "kron":
            attrs["H"] = la.H
            attrs["scale"] = la.posterior_scale
        if structure == "diag":
            attrs["variance"] = la.posterior_variance
        if structure == "full":
            attrs["covariance"] = la.posterior_covariance
        out.append({k: torch.as_tensor(v).detach() for k, v in attrs.items()})
    _assert_same(out[0], out[1])


@pytest.mark.parametrize("structure", ["full", "diag", "kron"])
def test_prior_mean_layer_prior_and_temperature_equal_laplace_torch(structure):
    lt = _original()
    model, x, _, loader = _classification()
    out = []
    for lib in (lt, compat):
        la = lib.Laplace(
            model,
            "classification",
            "all",
            structure,
            prior_mean=torch.linspace(-0.2, 0.2, 51),
            prior_precision=torch.linspace(0.5, 2.0, 4),
            temperature=0.3,
        )
        la.fit(loader)
        out.append(
            (
                la.log_marginal_likelihood().detach(),
                la(x[:4]),
                la(x[:4], link_approx="mc", n_samples=5).shape,
            )
        )
    for ref, ours in zip(*out, strict=True):
        _close(torch.as_tensor(ours).double(), torch.as_tensor(ref).double())
