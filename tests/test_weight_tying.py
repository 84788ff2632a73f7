"""Weight tying (issue 22): a tensor shared by several modules (an embedding tied to the output
layer, a layer reused) is one parameter, counted once as ``model.parameters()`` does, and its
Jacobian column sums the contributions of every use; full / diag / lowrank agree with a float64
brute-force Jacobian over the unique parameters (tests/bruteforce_ggn.py); kron refuses, naming
the tied names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bruteforce_ggn as bf
import gaussify as gs
from gaussify.curvature.subset import select_parameters, tied_parameters

DELTA = 1.5


class TiedLM(nn.Module):
    """Embedding tied to the output layer; ``head_first`` registers the head first, so the
    tensor's canonical name is ``head.weight`` (the output layer's)."""

    def __init__(self, vocab: int = 7, d: int = 4, head_first: bool = False) -> None:
        super().__init__()
        self.mid = nn.Linear(d, d)
        if head_first:
            self.head = nn.Linear(d, vocab)
            self.emb = nn.Embedding(vocab, d)
            self.emb.weight = self.head.weight
        else:
            self.emb = nn.Embedding(vocab, d)
            self.head = nn.Linear(d, vocab)
            self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x))).mean(1))


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randint(0, 7, (9, 3), generator=g),
        torch.randint(0, 7, (9,), generator=g),
        torch.randint(0, 7, (3, 3), generator=g),
    )


def test_tied_parameters_and_subset_count_a_shared_tensor_once() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    assert tied_parameters(model) == {"emb.weight": ("emb.weight", "head.weight")}
    sub = select_parameters(model, "all")
    assert sub.num_params == sum(p.numel() for p in model.parameters()) == 7 * 4 + 20 + 7
    # an alias or a module using the tied tensor selects its canonical name
    assert select_parameters(model, ["head.weight"]).names == ("emb.weight",)
    assert select_parameters(model, ["head"]).names == ("emb.weight", "head.bias")
    assert select_parameters(model, "last_layer").names == ("emb.weight", "head.bias")
    assert select_parameters(TiedLM(head_first=True), "last_layer").names == ("head.weight",)


@pytest.mark.parametrize("head_first", [False, True])
@pytest.mark.parametrize("structure", ["full", "diag", "lowrank"])
def test_tied_model_matches_the_bruteforce_jacobian(structure: str, head_first: bool) -> None:
    """log Z and the GLM predictive of a tied model equal the brute-force computation with the
    shared tensor once (head_first used to take the last-layer route J = I ⊗ phi, which misses
    the embedding's use of the tensor)."""
    torch.manual_seed(0)
    model = TiedLM(head_first=head_first).double().eval()
    x, y, xt = _data()
    bf.assert_laplace_matches(model, x, y, xt, structure, DELTA)


@pytest.mark.parametrize(
    ("subset", "names"),
    [("last_layer", ("head.weight",)), (["head"], ("head.weight", "head.bias"))],
)
@pytest.mark.parametrize("structure", ["full", "diag"])
def test_output_layer_subset_of_a_tied_head_sums_both_uses(
    structure: str, subset: str | list[str], names: tuple[str, ...]
) -> None:
    """A subset of the output layer whose weight is tied to the embedding covers the shared
    tensor, and its Jacobian is d f / d W through the head and the embedding together (brute
    force over the selected tensors, the others fixed). Before, ``["head"]`` took the
    last-layer route J = I ⊗ [phi, 1], which misses the embedding's use, and 'last_layer'
    selected nothing."""
    torch.manual_seed(0)
    model = TiedLM(head_first=True).double().eval()
    x, y, _ = _data()
    la = gs.Laplace(
        model, "classification", structure=structure, subset=subset, prior_precision=DELTA
    ).fit((x, y))
    assert la.subset.names == names
    named = dict(model.named_parameters())
    counts = [named[n].numel() for n in names]

    def f(flat: torch.Tensor) -> torch.Tensor:
        parts = flat.split(counts)
        params = {n: t.view_as(named[n]) for n, t in zip(names, parts, strict=True)}
        return torch.func.functional_call(model, params, (x,))

    jac = torch.func.jacrev(f)(torch.cat([named[n].detach().reshape(-1) for n in names]))
    with torch.no_grad():
        lam = bf.softmax_hessian(model(x))
    g = torch.einsum("nci,ncd,ndj->ij", jac, lam, jac)
    expected = g + DELTA * torch.eye(g.shape[0], dtype=g.dtype)
    if structure == "diag":
        expected = torch.diag(expected.diagonal())
    torch.testing.assert_close(la.posterior_precision, expected, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("head_first", [True, False])
def test_kron_gives_a_tied_tensor_its_exact_block(head_first: bool) -> None:
    """kron never refuses a tied model (issue 22): the shared tensor has no Kronecker form, so
    its module's tensors get exact GGN blocks (one warning naming the tie), equal to the full
    GGN's diagonal blocks; the tie is counted once in the parameter vector."""
    torch.manual_seed(0)
    model = TiedLM(head_first=head_first).double().eval()
    x, y, _ = _data()
    with pytest.warns(UserWarning, match="shares its parameter"):
        kron = gs.Laplace(model, "classification", structure="kron", prior_precision=DELTA)
        kron.fit((x, y))
    full = gs.Laplace(model, "classification", structure="full", prior_precision=DELTA)
    full.fit((x, y))
    names = list(kron.subset.names)
    assert names == list(full.subset.names)
    assert len(names) == 4  # mid.weight, mid.bias, the shared tensor once, head.bias
    pk = kron.posterior_precision
    pf = full.posterior_precision
    sizes = [model.get_parameter(n).numel() for n in names]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    tied = next(i for i, n in enumerate(names) if n.endswith("weight") and "mid" not in n)
    for i in (tied, names.index("head.bias")):
        block = slice(offsets[i], offsets[i] + sizes[i])
        torch.testing.assert_close(pk[block, block], pf[block, block], rtol=1e-10, atol=1e-12)


def test_nn_predictive_keeps_the_tie_in_every_weight_sample() -> None:
    """method='nn' on a tied model: each sample's network uses the sampled shared tensor in
    both places (the brute force writes it into both modules)."""
    torch.manual_seed(0)
    model = TiedLM(head_first=True).double().eval()
    x, y, xt = _data()
    la = gs.Laplace(model, "classification", structure="diag", prior_precision=DELTA)
    la.fit((x, y))
    pred = la.predict(xt, method="nn", num_samples=4, generator=torch.Generator().manual_seed(5))
    thetas = la.sample(4, torch.Generator().manual_seed(5))
    expected = []
    for theta in thetas:
        mw, mb, w, b = theta.split([16, 4, 28, 7])  # mid, then the head (canonical)
        head = nn.functional.linear
        h = torch.tanh(head(nn.functional.embedding(xt, w.view(7, 4)), mw.view(4, 4), mb))
        expected.append(head(h.mean(1), w.view(7, 4), b))
    torch.testing.assert_close(pred.f_samples, torch.stack(expected), atol=1e-12, rtol=1e-10)
