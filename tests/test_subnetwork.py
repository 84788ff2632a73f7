"""Subnetwork inference (Daxberger et al. 2021): a Laplace posterior over individual weights.

Oracles are plain ``torch.autograd.functional.jacobian`` of the network as a function of the
vector of all trainable weights (float64): the subnetwork's posterior precision must be the
(S, S) block of the all-weights GGN + prior, its GLM predictive J_S Sigma_S J_S^T, its evidence
the closed form over S, and a subnetwork of whole tensors must reproduce the tensor subset.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

import gaussify as gs
from gaussify.curvature import make_curvature
from gaussify.curvature.jacobian import jacobians, jvp, per_sample_vjp, squared_vjp_sum, vjp
from gaussify.curvature.subset import ParameterSubset, select_parameters
from gaussify.function_space.ntk import ntk

N, D, H, C = 30, 3, 6, 2
PRIOR = 0.7


def mlp(seed: int = 0, out: int = C) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, out)).double().eval()


def data(task: str) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, D, generator=gen, dtype=torch.float64)
    if task == "classification":
        return x, torch.randint(0, C, (N,), generator=gen)
    return x, torch.randn(N, C, generator=gen, dtype=torch.float64)


def theta_all(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


def jac_all(model: nn.Module, x: Tensor) -> Tensor:
    """J (N, C, P_all) by torch.autograd.functional.jacobian of f(x; vector of all weights)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    shapes = [p.shape for n, p in model.named_parameters() if p.requires_grad]

    def f(vec: Tensor) -> Tensor:
        params = dict(zip(names, vec.split([s.numel() for s in shapes]), strict=True))
        params = {n: v.reshape(s) for (n, v), s in zip(params.items(), shapes, strict=True)}
        return functional_call(model, params, (x,))

    return torch.autograd.functional.jacobian(f, theta_all(model))


def hessians(model: nn.Module, x: Tensor, task: str, sigma: float = 1.0) -> Tensor:
    """Lambda_n (N, C, C): softmax diag(p) - p p^T, or I / sigma^2."""
    with torch.no_grad():
        f = model(x)
    if task == "classification":
        p = torch.softmax(f, -1)
        return torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    return torch.eye(f.shape[1], dtype=f.dtype).expand(f.shape[0], -1, -1) / sigma**2


def ggn_all(model: nn.Module, x: Tensor, task: str, sigma: float = 1.0) -> Tensor:
    jac = jac_all(model, x)
    return torch.einsum("ncp,ncd,ndq->pq", jac, hessians(model, x, task, sigma), jac)


def some_indices(shift: int = 0) -> Tensor:
    """Nine indices spread over all four tensors (0.weight: 0-17, 0.bias: 18-23, 2.weight:
    24-35, 2.bias: 36-37), partial in each."""
    return torch.tensor([1, 4, 10, 17 - shift, 19, 22 + shift, 25, 31, 37])


def close(a: Tensor, b: Tensor, rtol: float = 1e-9, atol: float = 1e-11) -> None:
    torch.testing.assert_close(a, b.to(a.dtype), rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- resolution


def test_indices_resolve_to_the_support_tensors_and_local_positions() -> None:
    model = mlp()
    model[0].bias.requires_grad_(False)  # indices refer to the trainable weights only
    sizes = [18, 12, 2]  # 0.weight, 2.weight, 2.bias
    idx = torch.tensor([31, 0, 5, 19])  # unsorted on purpose
    sub = select_parameters(model, idx, subnetwork=True)
    assert sub.names == ("0.weight", "2.weight", "2.bias")
    assert sub.num_params == 4 and sub.counts == (2, 1, 1)
    vec = theta_all(model)
    assert sum(sizes) == vec.numel()
    close(sub.flatten(sub.params(model)), vec[idx.sort().values], rtol=0, atol=0)
    # unflatten puts the vector back in place; the rest comes from base (or is 0)
    full = sub.unflatten(torch.arange(1.0, 5.0, dtype=torch.float64), base=sub.params(model))
    back = torch.cat([full[n].reshape(-1) for n in sub.names])
    expected = vec.clone()
    expected[idx.sort().values] = torch.arange(1.0, 5.0, dtype=torch.float64)
    close(back, expected, rtol=0, atol=0)
    zero = sub.unflatten(torch.ones(4, dtype=torch.float64))
    assert float(torch.cat([v.reshape(-1) for v in zero.values()]).sum()) == 4.0
    # a mask is the same subnetwork
    mask = torch.zeros(vec.numel(), dtype=torch.bool)
    mask[idx] = True
    assert torch.equal(select_parameters(model, mask, subnetwork=True).indices, sub.indices)
    # only tensors containing selected weights are differentiated
    assert select_parameters(model, torch.tensor([20, 21]), subnetwork=True).names == ("2.weight",)


def test_a_mask_over_whole_tensors_is_the_tensor_subset() -> None:
    model = mlp()
    mask = torch.zeros(theta_all(model).numel(), dtype=torch.bool)
    mask[24:] = True  # 2.weight and 2.bias
    sub = select_parameters(model, mask, subnetwork=True)
    assert sub.indices is None and sub.names == ("2.weight", "2.bias")


# ----------------------------------------------------------------------------- Jacobians


def test_jacobian_products_gather_the_selected_columns() -> None:
    model = mlp()
    x, _ = data("classification")
    idx = some_indices()
    sub = select_parameters(model, idx, subnetwork=True)
    oracle = jac_all(model, x)[..., idx]  # (N, C, 9)
    close(jacobians(model, x, idx, chunk_size=7), oracle)
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(N, 3, C, generator=gen, dtype=torch.float64)
    close(per_sample_vjp(model, x, sub, u, chunk_size=4), torch.einsum("nkc,ncp->nkp", u, oracle))
    total, _ = squared_vjp_sum(model, x, sub, lambda f: u, chunk_size=5)
    close(total, torch.einsum("nkc,ncp->nkp", u, oracle).square().sum((0, 1)))
    v = torch.randn(len(idx), generator=gen, dtype=torch.float64)
    close(jvp(model, x, sub, v), oracle @ v)
    close(vjp(model, x, sub, u[:, 0]), torch.einsum("nc,ncp->p", u[:, 0], oracle))


# ----------------------------------------------------------------------------- posterior


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_posterior_precision_is_the_block_of_the_all_weights_ggn(task: str) -> None:
    model = mlp()
    x, y = data(task)
    sigma = 0.6 if task == "regression" else 1.0  # only regression has observation noise
    idx = some_indices()
    block = ggn_all(model, x, task, sigma)[idx][:, idx]
    expected = block + PRIOR * torch.eye(len(idx), dtype=torch.float64)
    kwargs = {"prior_precision": PRIOR, "sigma_noise": sigma}
    full = gs.Laplace(model, task, "full", subset=idx, **kwargs).fit((x, y), batch_size=8)
    close(full.posterior_precision, expected)
    # the same block of the library's all-weights posterior
    every = gs.Laplace(model, task, "full", **kwargs).fit((x, y), batch_size=8)
    close(full.posterior_precision, every.posterior_precision[idx][:, idx])
    diag = gs.Laplace(model, task, "diag", subset=idx, **kwargs).fit((x, y), batch_size=8)
    close(diag.posterior_precision, torch.diag(expected.diagonal()))
    dense = gs.Laplace(model, task, "lowrank", subset=idx, rank=len(idx), **kwargs)
    close(dense.fit((x, y)).posterior_precision, expected)
    # low rank k < |S|: the top-k eigenvalues of the block and its exact diagonal
    k = 3
    low = gs.Laplace(model, task, "lowrank", subset=idx, rank=k, **kwargs).fit((x, y))
    evals, _ = low._curvature.eigendecomposition()
    close(evals, torch.linalg.eigvalsh(block).flip(0)[:k], rtol=1e-7)
    close(low.posterior_precision.diagonal(), expected.diagonal(), rtol=1e-8)


def test_per_tensor_prior_applies_to_the_selected_weights_of_each_tensor() -> None:
    model = mlp()
    x, y = data("classification")
    idx = some_indices()
    la = gs.Laplace(model, "classification", "diag", subset=idx)
    per_tensor = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    assert la.subset.names == ("0.weight", "0.bias", "2.weight", "2.bias")
    la.prior_precision = per_tensor
    la.fit((x, y))
    owner = torch.searchsorted(torch.tensor([18, 24, 36, 38]), idx, right=True)
    block = ggn_all(model, x, "classification").diagonal()[idx]
    close(la.posterior_precision.diagonal(), block + per_tensor[owner])


# ----------------------------------------------------------------------------- predictive


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_glm_predictive_is_js_sigma_js(structure: str) -> None:
    model = mlp()
    x, y = data("classification")
    idx = some_indices()
    la = gs.Laplace(model, "classification", structure, subset=idx, prior_precision=PRIOR)
    la.fit((x, y), batch_size=8)
    precision = ggn_all(model, x, "classification")[idx][:, idx]
    if structure == "diag":
        precision = torch.diag(precision.diagonal())
    sigma = torch.linalg.inv(precision + PRIOR * torch.eye(len(idx), dtype=torch.float64))
    xt = torch.randn(7, D, dtype=torch.float64)
    js = jac_all(model, xt)[..., idx]
    pred = la.predict(xt, chunk_size=3)
    close(pred.f_cov, js @ sigma @ js.transpose(1, 2))
    close(pred.f_mean, model(xt).detach())
    joint = la.predict(xt, joint=True).joint_cov
    stacked = js.reshape(-1, len(idx))
    close(joint, stacked @ sigma @ stacked.T)


def test_samples_keep_the_other_weights_at_the_map() -> None:
    model = mlp()
    x, y = data("regression")
    idx = some_indices()
    la = gs.Laplace(model, "regression", "full", subset=idx, prior_precision=PRIOR)
    la.fit((x, y))
    short = la.sample(5, torch.Generator().manual_seed(4))
    full = la.sample(5, torch.Generator().manual_seed(4), full=True)
    assert short.shape == (5, len(idx)) and full.shape == (5, theta_all(model).numel())
    rest = torch.ones(full.shape[1], dtype=torch.bool)
    rest[idx] = False
    assert torch.equal(full[:, rest], theta_all(model)[rest].expand(5, -1))
    assert torch.equal(full[:, idx], short)
    # sample moments converge to (theta*_S, Sigma_S)
    many = la.sample(40000, torch.Generator().manual_seed(5))
    cov = torch.cov(many.T)
    scale = la.posterior_covariance.diagonal().sqrt()
    err = (cov - la.posterior_covariance) / (scale[:, None] * scale[None, :])
    assert float(err.abs().max()) < 0.05  # MC standard error ~ sqrt(2 / 40000) = 0.007
    # the NN predictive runs the network at the full vectors
    outs = la._nn_samples(x[:4], 3, torch.Generator().manual_seed(6))
    vectors = la.sample(3, torch.Generator().manual_seed(6), full=True)
    for s in range(3):
        clone = copy.deepcopy(model)
        nn.utils.vector_to_parameters(vectors[s], clone.parameters())
        close(outs[s], clone(x[:4]).detach())
    samples = la.function_samples(x[:4], 3, method="nn", generator=torch.Generator().manual_seed(6))
    close(samples, outs)
    # full=True for a tensor subset: the other tensors at their current values
    last = gs.Laplace(model, "regression", "diag", subset="last_layer").fit((x, y))
    vectors = last.sample(2, torch.Generator().manual_seed(7), full=True)
    assert torch.equal(vectors[:, :24], theta_all(model)[:24].expand(2, -1))
    assert torch.equal(vectors[:, 24:], last.sample(2, torch.Generator().manual_seed(7)))


# ----------------------------------------------------------------------------- evidence


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_log_marginal_likelihood_is_the_closed_form_over_the_subnetwork(task: str) -> None:
    model = mlp()
    x, y = data(task)
    sigma = 0.8 if task == "regression" else 1.0  # only regression has observation noise
    idx = some_indices()
    la = gs.Laplace(model, task, "full", subset=idx, prior_precision=PRIOR, sigma_noise=sigma)
    la.fit((x, y), batch_size=11)
    js = jac_all(model, x)[..., idx]
    precision = ggn_all(model, x, task, sigma)[idx][:, idx]
    precision = precision + PRIOR * torch.eye(len(idx), dtype=torch.float64)
    with torch.no_grad():
        f = model(x)
    if task == "classification":
        log_lik = -nn.functional.cross_entropy(f, y, reduction="sum")
        r = nn.functional.one_hot(y, C).double() - torch.softmax(f, -1)
    else:
        log_lik = (
            -0.5 * ((y - f) / sigma).square() - math.log(sigma * math.sqrt(2 * math.pi))
        ).sum()
        r = (y - f) / sigma**2
    theta = theta_all(model)[idx]
    b = torch.einsum("nc,ncp->p", r, js) - PRIOR * theta
    expected = (
        log_lik
        - 0.5 * PRIOR * theta.square().sum()
        + 0.5 * (len(idx) * math.log(PRIOR) - torch.logdet(precision))
        + 0.5 * b @ torch.linalg.solve(precision, b)
    )
    close(la.log_marginal_likelihood(), expected)


def test_optimize_prior_finds_the_evidence_maximum() -> None:
    # a MAP of a teacher's labels (at random weights the evidence grows without bound in P0)
    model = mlp()
    x, _ = data("classification")
    with torch.no_grad():
        y = mlp(5)(x).argmax(-1)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(300):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y, reduction="sum")
        (loss + 0.5 * sum(p.square().sum() for p in model.parameters())).backward()
        opt.step()
    idx = some_indices()
    la = gs.Laplace(model, "classification", "full", subset=idx).fit((x, y))
    la.optimize_prior(n_steps=300, lr=0.1)
    best = la.log_marginal_likelihood()
    with torch.no_grad():
        grid = torch.logspace(-3, 3, 601, dtype=torch.float64)
        values = torch.stack([la.log_marginal_likelihood(v) for v in grid])
    assert float(best) >= float(values.max()) - 1e-4
    # within one grid step (0.01 decades) of the grid's best prior
    assert abs(math.log10(float(la.prior_precision) / float(grid[values.argmax()]))) < 0.011
    # per-tensor ("layer") granularity gives one prior per support tensor
    la.optimize_prior(granularity="layer", n_steps=20)
    assert la.prior_precision.shape == (4,)


def test_refine_takes_the_exact_newton_step_on_the_subnetwork() -> None:
    model = mlp()
    x, y = data("regression")
    idx = some_indices()
    la = gs.Laplace(model, "regression", "full", subset=idx, prior_precision=PRIOR).fit((x, y))
    js = jac_all(model, x)[..., idx]
    with torch.no_grad():
        r = y - model(x)
    theta = theta_all(model)[idx]
    precision = torch.einsum("ncp,ncq->pq", js, js) + PRIOR * torch.eye(len(idx)).double()
    step = torch.linalg.solve(precision, torch.einsum("nc,ncp->p", r, js) - PRIOR * theta)
    la.refine((x, y))
    close(la.mean, theta + step, rtol=1e-8)


# ----------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("structure", ["full", "diag", "lowrank"])
def test_forced_index_path_over_whole_tensors_equals_the_tensor_subset(structure: str) -> None:
    model = mlp()
    x, y = data("classification")
    names = select_parameters(model, ["0"])
    forced = ParameterSubset(names.names, names.shapes, indices=torch.arange(names.num_params))
    opts = {"rank": 5} if structure == "lowrank" else {}
    ref, idx = (
        gs.Laplace(
            model,
            "classification",
            structure,
            subset=subset,
            prior_precision=PRIOR,
            generator=torch.Generator().manual_seed(0),
            **opts,
        ).fit((x, y), batch_size=9)
        for subset in (["0"], forced)
    )
    close(idx.posterior_precision, ref.posterior_precision, rtol=1e-8)
    xt = torch.randn(5, D, dtype=torch.float64)
    close(idx.predict(xt).f_cov, ref.predict(xt).f_cov, rtol=1e-8)
    close(idx.log_marginal_likelihood(), ref.log_marginal_likelihood(), rtol=1e-10)
    prior = torch.tensor([0.5, 2.0], dtype=torch.float64)
    close(idx.log_marginal_likelihood(prior), ref.log_marginal_likelihood(prior), rtol=1e-10)
    # and a mask over the same tensors resolves to the tensor subset itself
    mask = torch.zeros(theta_all(model).numel(), dtype=torch.bool)
    mask[: names.num_params] = True
    assert gs.Laplace(model, "classification", structure, subset=mask).subset.indices is None


# ----------------------------------------------------------------------------- state


def test_state_dict_round_trip_and_subnetwork_mismatch() -> None:
    model = mlp()
    x, y = data("classification")
    idx = some_indices()
    la = gs.Laplace(model, "classification", "full", subset=idx, prior_precision=PRIOR)
    la.fit((x, y))
    state = la.state_dict()
    again = gs.Laplace(model, "classification", "full", subset=idx)
    again.load_state_dict(state)
    xt = torch.randn(4, D, dtype=torch.float64)
    close(again.predict(xt).f_cov, la.predict(xt).f_cov, rtol=0, atol=0)
    close(again.log_marginal_likelihood(), la.log_marginal_likelihood(), rtol=0, atol=0)
    other = gs.Laplace(model, "classification", "full", subset=some_indices(shift=1))
    with pytest.raises(ValueError, match="different subnetwork"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="different subnetwork"):
        gs.Laplace(model, "classification", "full").load_state_dict(state)


# ----------------------------------------------------------------------------- selectors


def test_largest_magnitude_picks_the_largest_absolute_weights() -> None:
    model = mlp()
    model[0].bias.requires_grad_(False)
    vec = theta_all(model)
    got = gs.subnetwork.largest_magnitude(model, 6)
    order = vec.abs().argsort(descending=True)
    assert torch.equal(got, order[:6].sort().values)
    chosen = torch.zeros_like(vec, dtype=torch.bool)
    chosen[got] = True
    assert float(vec[chosen].abs().min()) > float(vec[~chosen].abs().max())


def test_largest_variance_is_the_top_of_the_diag_laplace_variance() -> None:
    model = mlp()
    x, y = data("classification")
    got = gs.subnetwork.largest_variance(model, "classification", (x, y), 7, prior_precision=0.3)
    variance = 1.0 / (ggn_all(model, x, "classification").diagonal() + 0.3)
    assert torch.equal(got, variance.argsort(descending=True)[:7].sort().values)
    diag = gs.Laplace(model, "classification", "diag", prior_precision=0.3).fit((x, y))
    assert torch.equal(got, gs.subnetwork.largest(diag.posterior_variance, 7))
    # the subnetwork built from it has the corresponding precision block
    la = gs.Laplace(model, "classification", "full", subset=got, prior_precision=0.3)
    la.fit((x, y))
    expected = ggn_all(model, x, "classification")[got][:, got] + 0.3 * torch.eye(7).double()
    close(la.posterior_precision, expected)


def test_random_and_by_name_selectors() -> None:
    model = mlp()
    total = gs.subnetwork.num_weights(model)
    a = gs.subnetwork.random(model, 5, torch.Generator().manual_seed(0))
    b = gs.subnetwork.random(model, 5, torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and a.unique().numel() == 5
    assert bool((a >= 0).all() and (a < total).all()) and torch.equal(a, a.sort().values)
    # uniform: every weight is chosen with probability n / P
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(total)
    reps = 2000
    for _ in range(reps):
        counts[gs.subnetwork.random(model, 5, gen)] += 1
    expected = reps * 5 / total
    assert float((counts - expected).abs().max()) < 5 * math.sqrt(expected)
    assert torch.equal(gs.subnetwork.by_name(model, ["2"]), torch.arange(24, 38))
    assert torch.equal(gs.subnetwork.by_name(model, "0.bias"), torch.arange(18, 24))


# ----------------------------------------------------------------------------- errors


def test_bad_subnetworks_raise_naming_the_argument() -> None:
    model = mlp()
    total = theta_all(model).numel()
    cases = [
        (torch.ones(total + 1, dtype=torch.bool), ValueError, "one entry per trainable"),
        (torch.ones(2, total, dtype=torch.bool), ValueError, "one entry per trainable"),
        (torch.tensor([0, total]), ValueError, r"must lie in \[0, 38\)"),
        (torch.tensor([-1, 3]), ValueError, "must lie in"),
        (torch.tensor([3, 5, 3]), ValueError, "unique, got 3 more than once"),
        (torch.zeros(total, dtype=torch.bool), ValueError, "empty"),
        (torch.tensor([], dtype=torch.long), ValueError, "empty"),
        (torch.tensor([[1, 2]]), ValueError, "1-D"),
        (torch.tensor([1.0, 2.0]), TypeError, "boolean mask or an integer tensor"),
        ([1, 2], TypeError, "names must be strings"),
    ]
    for spec, error, message in cases:
        with pytest.raises(error, match=f"subset: .*{message}"):
            gs.Laplace(model, "classification", "full", subset=spec)
    idx = some_indices()
    with pytest.raises(ValueError, match=r"subset: structure 'kron' .*per layer"):
        gs.Laplace(model, "classification", "kron", subset=idx)
    with pytest.raises(ValueError, match="subset: structure 'kron'"):
        make_curvature("kron", model, "classification", idx)
    with pytest.raises(ValueError, match=r"subset: a subnetwork .* supported by gs\.Laplace"):
        gs.LGVA(model, "classification", subset=idx)
    with pytest.raises(ValueError, match=r"subset: a subnetwork .* supported by gs\.Laplace"):
        ntk(model, torch.randn(2, D).double(), subset=idx)
    forced = select_parameters(model, idx, subnetwork=True)
    with pytest.raises(ValueError, match="subset: this computation needs whole parameter"):
        ntk(model, torch.randn(2, D).double(), subset=forced)
    with pytest.raises(ValueError, match="indices: expected a non-empty, strictly increasing"):
        ParameterSubset(forced.names, forced.shapes, indices=torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="n: expected 1 <= n <= 38"):
        gs.subnetwork.largest_magnitude(model, 0)
    with pytest.raises(TypeError, match="n: expected an integer"):
        gs.subnetwork.random(model, 2.0)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- laplace-torch


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_parity_with_laplace_torch_subnet_laplace(structure: str) -> None:
    laplace = pytest.importorskip("laplace")
    from laplace.utils import LargestMagnitudeSubnetMask
    from torch.utils.data import DataLoader, TensorDataset

    model = mlp()
    x, y = data("classification")
    lt_idx = LargestMagnitudeSubnetMask(model, n_params_subnet=10).select()
    idx = gs.subnetwork.largest_magnitude(model, 10)
    assert torch.equal(lt_idx.sort().values.cpu(), idx)
    lt_idx = lt_idx.sort().values  # laplace-torch keeps the order it is given
    kinds = {"full": laplace.FullSubnetLaplace, "diag": laplace.DiagSubnetLaplace}
    ref = kinds[structure](
        model, "classification", subnetwork_indices=lt_idx, prior_precision=PRIOR
    )
    ref.fit(DataLoader(TensorDataset(x, y), batch_size=10))
    la = gs.Laplace(
        model, "classification", structure, subset=idx, prior_precision=PRIOR, correction=False
    ).fit((x, y), batch_size=10)
    # measured: agreement to ~1e-15 relative; the tolerance leaves room for a laplace-torch
    # backend that rounds its GGN to float32 (see test_laplace_torch_parity.py)
    tol = {"rtol": 1e-6, "atol": 1e-8}
    ref_precision = ref.posterior_precision.double()
    if structure == "diag":
        ref_precision = torch.diag(ref_precision)
    torch.testing.assert_close(la.posterior_precision, ref_precision, **tol)
    xt = torch.randn(6, D, dtype=torch.float64)
    f_mu, f_var = ref._glm_predictive_distribution(xt)
    pred = la.predict(xt)
    torch.testing.assert_close(pred.f_mean, f_mu.double(), **tol)
    torch.testing.assert_close(pred.f_cov, f_var.double(), **tol)
    lml = ref.log_marginal_likelihood(torch.tensor(PRIOR, dtype=torch.float64))
    torch.testing.assert_close(la.log_marginal_likelihood(), lml.double(), **tol)
    full = la.sample(3, full=True)
    assert full.shape == ref.sample(3).shape


def test_reward_model_on_a_subnetwork_pushes_the_posterior_through_r() -> None:
    from gaussify.weight_space import BradleyTerry, predict_reward, preference_pairs

    net = mlp(out=1)
    gen = torch.Generator().manual_seed(2)
    a, b = (torch.randn(N, D, generator=gen, dtype=torch.float64) for _ in range(2))
    y = torch.randint(0, 2, (N, 1), generator=gen).double()
    idx = torch.tensor([2, 7, 20, 25, 30])  # indices of the pair model = those of r
    la = gs.Laplace(BradleyTerry(net), "binary", "full", subset=idx, prior_precision=PRIOR)
    la.fit((preference_pairs(a, b), y))
    xt = torch.randn(4, D, dtype=torch.float64)
    js = jac_all(net, xt)[..., idx]
    close(predict_reward(la, xt).f_cov, js @ la.posterior_covariance @ js.transpose(1, 2))
    # and the pair posterior is the block of the GGN of r(a) - r(b)
    jd = jac_all(net, a)[..., idx] - jac_all(net, b)[..., idx]
    with torch.no_grad():
        p = torch.sigmoid(net(a) - net(b))
    precision = torch.einsum("ncp,nc,ncq->pq", jd, p * (1 - p), jd) + PRIOR * torch.eye(5).double()
    close(la.posterior_precision, precision)


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_subnetwork_of_a_cnn_takes_the_conv_route_and_matches_the_oracle(structure: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 5 * 5, C)
    ).double()
    model.eval()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(12, 1, 5, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, C, (12,), generator=gen)
    idx = torch.tensor([0, 5, 17, 19, 30, 77])  # conv weight, conv bias, linear weight
    la = gs.Laplace(model, "classification", structure, subset=idx, prior_precision=PRIOR)
    la.fit((x, y), batch_size=5)
    expected = ggn_all(model, x, "classification")[idx][:, idx]
    if structure == "diag":
        expected = torch.diag(expected.diagonal())
    close(la.posterior_precision, expected + PRIOR * torch.eye(6).double())
