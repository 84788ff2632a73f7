"""Laplace over the parameters that require gradients (LoRA adapters on a frozen backbone)."""

import importlib.util
from pathlib import Path

import torch

import gaussify as gs
from gaussify.curvature.jacobian import jacobians

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "lora_transformer.py"


def _example():
    spec = importlib.util.spec_from_file_location("lora_transformer", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_adapter_posterior_is_the_block_of_the_all_parameter_ggn() -> None:
    ex = _example()
    torch.manual_seed(0)
    model = ex.adapt(ex.TinyTransformer()).double().eval()
    for name, p in model.named_parameters():
        if name.endswith("lora_b"):
            p.data.normal_(0, 0.3)  # B = 0 at initialisation would make dJ/dA vanish
    gen = torch.Generator().manual_seed(1)
    ids, y = ex.sequences(24, 1, gen)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all("lora" in n or n.startswith("head") for n in trainable)
    la = gs.Laplace(model, "classification", "full", subset="all", prior_precision=0.7)
    la.fit((ids, y), batch_size=10)
    assert la.subset.names == tuple(trainable)

    # oracle: the Jacobian with respect to every parameter, restricted to the adapter columns
    model.requires_grad_(True)
    jac = jacobians(model, ids, "all")
    names = [n for n, _ in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]
    cols = torch.cat(
        [
            torch.arange(start, start + size)
            for name, start, size in zip(
                names, torch.tensor([0, *sizes]).cumsum(0).tolist(), sizes, strict=False
            )
            if name in trainable
        ]
    )
    assert jac.shape[-1] == sum(sizes) > 20 * len(cols)
    j_sub = jac[..., cols]
    probs = torch.softmax(model(ids).detach(), -1)
    lam = torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]
    precision = torch.einsum("ncp,ncd,ndq->pq", j_sub, lam, j_sub) + 0.7 * torch.eye(
        len(cols), dtype=torch.float64
    )
    torch.testing.assert_close(la.posterior_precision, precision.double(), rtol=1e-9, atol=1e-10)
    # storage follows the subset: the curvature holds P_sub^2 numbers, not P_total^2
    assert la.posterior_precision.numel() == len(cols) ** 2
