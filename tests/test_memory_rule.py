"""The memory rule of the curvature fits, measured: a fit's peak of live allocations is at most
2 x (one training step's peak on the same batch + the curvature's storage) (issue 17).

Peaks are torch's live CPU allocations above the start, from the allocation events of
``torch.profiler`` (the measurement of ``benchmarks/curvature_fits.py``), on the benchmark's
CNN (conv 1 -> 16, ReLU, conv 16 -> 16, ReLU, max-pool 2, linear 256 -> C on 8 x 8 images) in
the two configurations that broke the rule on main: the diagonal GGN with C = 100 at batch 32
(one sample with all 100 vectors exceeds the budget: 2.25 x; now groups of vectors) and KFAC
with C = 10 at batch 256 (the transposed convolution's workspace was not counted: 2.01 x).
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from gaussify.curvature import make_curvature
from gaussify.curvature.batched_backward import (
    backward_peak,
    chain_forward,
    module_chain,
    rule_budget,
    rule_chunk,
    rule_columns,
    rule_margin,
)
from gaussify.curvature.fitting import fit_curvature

#: the benchmark's measurement of a peak (torch.profiler allocation events) and its CNN, not
#: copies of them
_FITS = runpy.run_path(
    str(Path(__file__).resolve().parents[1] / "benchmarks" / "curvature_fits.py")
)
alloc_peak = _FITS["alloc_peak"]


def cnn(c: int) -> nn.Sequential:
    """The benchmark's CNN (seeded): conv16-ReLU-conv16-ReLU-maxpool2-linear(256 -> c)."""
    return _FITS["build_model"]("cnn", c).eval()


def train_step(model: nn.Module, x: Tensor, y: Tensor) -> None:
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    ("structure", "classes", "batch"),
    [
        pytest.param("diag", 100, 32, marks=pytest.mark.slow),  # the benchmark's case, ~3 s
        ("diag", 100, 8),  # the same regime (one sample's 100 vectors exceed the budget)
        ("kron", 10, 256),
    ],
)
def test_fit_peak_within_twice_a_training_step_and_storage(
    structure: str, classes: int, batch: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(batch, 1, 8, 8, generator=gen)
    y = torch.randint(0, classes, (batch,), generator=gen)
    model = cnn(classes)
    options = {"kron_bias": "separate"} if structure == "kron" else {}

    def fit():  # type: ignore[no-untyped-def]
        curv = make_curvature(structure, model, "classification", **options)
        curv.update(model, x, y)  # the peak is per batch
        return curv

    fit()  # warm-up: one-time allocations of the first call are not the fit's
    curv, peak = alloc_peak(fit)
    _, step = alloc_peak(lambda: train_step(cnn(classes), x, y))
    storage = sum(t.numel() * t.element_size() for t in curv.state_dict().values())
    assert peak <= 2 * (step + storage), (peak, step, storage)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize(
    ("structure", "classes", "batch"),
    [("diag", 2, 32), ("diag", 10, 32), ("kron", 10, 32), ("kron", 2, 32), ("diag", 10, 256)],
)
def test_cuda_fit_peak_within_twice_a_training_step_and_storage(
    structure: str, classes: int, batch: int
) -> None:
    """The rule on CUDA (the caching allocator's ``max_memory_allocated``, as the benchmark
    measures it), over the benchmark's first two batches of digits (its own data path): the
    diagonal with C = 2 at batch 32 reached 2.03 x with the CPU's margin (rule_margin)."""
    x, y = _FITS["load_data"]("cnn", classes, torch.float32, "cuda")
    model = cnn(classes).cuda()
    options = {"kron_bias": "separate"} if structure == "kron" else {}
    rows = slice(0, 2 * batch)

    def fit():  # type: ignore[no-untyped-def]
        curv = make_curvature(structure, model, "classification", **options)
        return fit_curvature(curv, model, (x[rows], y[rows]), batch)

    fit()
    curv, peak = alloc_peak(fit, "cuda")
    trained = _FITS["build_model"]("cnn", classes).cuda()
    _, step = alloc_peak(lambda: _FITS["train_step"](trained, x[:batch], y[:batch]), "cuda")
    storage = sum(t.numel() * t.element_size() for t in curv.state_dict().values())
    assert peak <= 2 * (step + storage), (peak, step, storage, peak / (step + storage))


def test_rule_margin_is_wider_on_cuda() -> None:
    """15 % of the rule kept free where the step estimate was calibrated (CPU), 25 % on CUDA
    (the budget's factor 1.7 and 1.5 of a step + storage); the CUDA peak itself is measured
    by the test above where a GPU is present."""
    assert rule_margin(torch.device("cpu")) == 3
    assert rule_margin(torch.device("cuda")) == 5
    assert rule_margin(torch.device("mps")) == 5  # not measured: the wider margin


def test_rule_columns_is_the_most_vectors_one_sample_fits() -> None:
    """With C = 100 at batch 32 one sample's 100 vectors exceed the diagonal's budget
    (rule_chunk gives 0 samples): rule_columns gives the most K' whose per-sample peak (and
    the sample's K C vectors) fits the budget, K' + 1 does not; with C = 10 it is K."""
    model = cnn(100)
    run = chain_forward(module_chain(model), torch.rand(32, 1, 8, 8))
    storage = sum(p.numel() for p in model.parameters())
    per = {0, 2, 6}
    assert rule_chunk(run, model, 100, storage, per, rowwise=True, copies=2, floor=0) == 0
    cols = rule_columns(run, model, 100, storage, per, rowwise=True, copies=2)
    budget = rule_budget(run, model, 100, storage, True, 2, 0) - 100 * 100
    assert 1 <= cols < 100
    assert backward_peak(run, cols, per) <= budget < backward_peak(run, cols + 1, per)
    small = cnn(10)
    run10 = chain_forward(module_chain(small), torch.rand(32, 1, 8, 8))
    storage10 = sum(p.numel() for p in small.parameters())
    assert rule_columns(run10, small, 10, storage10, per, rowwise=True, copies=2) == 10


def test_backward_peak_counts_the_transposed_convolution_workspace() -> None:
    """Propagating through a convolution that is not the first module: its two gradients
    K (out + in) and the CPU workspace, the incoming gradient in blocks of 16 channels
    (16 -> 16 channels: no reorder of the result) or also the result (16 -> 3 channels, padded
    to 16)."""
    k = 3
    for c_in, extra in ((16, 16 * 64), (3, 16 * 64 + 16 * 64)):
        model = nn.Sequential(nn.Identity(), nn.Conv2d(c_in, 16, 3, padding=1))
        run = chain_forward(module_chain(model), torch.rand(2, c_in, 8, 8))
        assert backward_peak(run, k, set()) == k * (16 * 64 + c_in * 64) + k * extra


def _wide_mlp(scale: float = 1.0) -> nn.Sequential:
    """3-200-200-4 (ReLU); ``scale`` multiplies the first layer and divides the last."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU())
    model.append(nn.Linear(200, 4))
    with torch.no_grad():
        model[0].weight.mul_(scale)
        model[0].bias.mul_(scale)
        model[4].weight.div_(scale)
    return model.eval()


def test_linear_chain_diagonal_has_no_batch_temporary() -> None:
    """On a chain of linear layers the diagonal's batch is added to the stored diagonal only
    once complete and checked (deferred, buffered sums), not summed into a P-sized temporary
    first: an update's peak (the curvature already allocated, P = 41,804 floats) stays below
    P floats, where summing apart alone takes P; the values equal the float64 oracle of two
    updates summed."""
    model = _wide_mlp()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, generator=gen), torch.randint(0, 4, (8,), generator=gen)
    curv = make_curvature("diag", model, "classification")
    curv.update(model, x[:4], y[:4])  # warm-up and the first batch
    _, peak = alloc_peak(lambda: curv.update(model, x[4:], y[4:]))
    p = curv.ggn_diag.numel()
    assert p == 41_804
    assert peak < p * curv.ggn_diag.element_size()
    ref = make_curvature("diag", model.double(), "classification")
    ref.update(model, x.double(), y)
    torch.testing.assert_close(curv.ggn_diag.double(), ref.ggn_diag, rtol=1e-5, atol=1e-9)


def test_linear_chain_diagonal_overflow_leaves_the_state_unchanged() -> None:
    """The deferred additions are checked before any is made: a first layer scaled by 1e20
    and the output layer by 1e-20 give finite outputs, but the second layer's squared inputs
    (about 1e40) exceed float32's range while its output gradients underflow (0 inf = NaN);
    the update raises naming that parameter (as summing apart did) and the stored diagonal
    and count stay as they were (after a good batch on the unscaled network)."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, generator=gen), torch.randint(0, 4, (4,), generator=gen)
    model = _wide_mlp()
    curv = make_curvature("diag", model, "classification")
    curv.update(model, x, y)
    before = curv.ggn_diag.clone()
    big = _wide_mlp(scale=1e20)
    with torch.no_grad():
        assert torch.isfinite(big(x)).all()
    with pytest.raises(ValueError, match=r"NaN Jacobian in parameter '2\.weight'"):
        curv.update(big, x, y)
    assert torch.equal(curv.ggn_diag, before)
    assert curv.num_data == 4


def mlp(c: int) -> nn.Sequential:
    """The benchmark's MLP (seeded): 64-100-100-c, ReLU."""
    return _FITS["build_model"]("mlp", c).eval()


@pytest.mark.parametrize(
    ("model_name", "classes", "batch", "flavour"),
    [
        ("mlp", 10, 256, "ef"),
        ("mlp", 10, 256, "ggn"),
        ("cnn", 10, 32, "ggn"),
        pytest.param("cnn", 100, 32, "ggn", marks=pytest.mark.slow),  # ~3 s
    ],
)
def test_deferred_fit_peak_within_twice_a_training_step_and_storage(
    model_name: str, classes: int, batch: int, flavour: str
) -> None:
    """A fit's deferred checks add each batch to the curvature directly (no batch
    temporary), so its chunks are planned with one storage-sized tensor: larger chunks,
    still within the rule, measured on a fit of two batches."""
    gen = torch.Generator().manual_seed(0)
    shape = (2 * batch, 64) if model_name == "mlp" else (2 * batch, 1, 8, 8)
    x = torch.rand(*shape, generator=gen)
    y = torch.randint(0, classes, (2 * batch,), generator=gen)
    build = mlp if model_name == "mlp" else cnn
    model = build(classes)

    def fit():  # type: ignore[no-untyped-def]
        curv = make_curvature("diag", model, "classification", ef=flavour == "ef")
        return fit_curvature(curv, model, (x, y), batch)

    fit()
    curv, peak = alloc_peak(fit)
    _, step = alloc_peak(lambda: train_step(build(classes), x[:batch], y[:batch]))
    storage = sum(t.numel() * t.element_size() for t in curv.state_dict().values())
    assert peak <= 2 * (step + storage), (peak, step, storage)


def test_deferred_fit_plans_without_a_batch_temporary(monkeypatch: pytest.MonkeyPatch) -> None:
    """The empirical Fisher of the benchmark's MLP (C = 50) on a batch of 256: one backward
    chunk per batch inside a fit (the batch added directly: one storage-sized tensor in the
    plan), two for a lone checked ``update`` (its deferred, buffered additions: the (N, out)
    buffers take budget; in float32, as the benchmark); the same diagonal to float32
    round-off. (C = 10 showed it until the ReLU masks the pass no longer holds freed budget.)"""
    from gaussify.curvature import chain_diag

    model = mlp(50)
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(256, 64, generator=gen)
    y = torch.randint(0, 50, (256,), generator=gen)
    chunks: list[int] = []
    real = chain_diag._reduce_chunk

    def counted(run, ut, rows, *args):  # type: ignore[no-untyped-def]
        chunks.append(rows.stop - rows.start)
        return real(run, ut, rows, *args)

    monkeypatch.setattr(chain_diag, "_reduce_chunk", counted)
    fitted = fit_curvature(make_curvature("diag", model, "classification", ef=True), model, (x, y))
    assert chunks == [256]
    chunks.clear()
    lone = make_curvature("diag", model, "classification", ef=True)
    lone.update(model, x, y)
    assert len(chunks) == 2 and sum(chunks) == 256
    torch.testing.assert_close(fitted.ggn_diag, lone.ggn_diag, rtol=1e-5, atol=1e-12)


def test_diagonal_chunk_grows_by_the_modelled_per_sample_peak() -> None:
    """What one more sample per chunk adds to a diagonal fit's measured peak is at most what
    the rule sizes the chunks by (backward_peak): on the benchmark's CNN (C = 10: 9 vectors)
    the largest per-sample set is the gradient through the second convolution, its adjoint's
    result and oneDNN's reorder of it, 3 x 9 x 1,024 numbers (110.6 kB); the convolution's
    patches (another 9,216 numbers) are freed before that product (they were held over it:
    147.5 kB measured per sample against the 110.6 kB modelled)."""
    torch.manual_seed(0)
    x = torch.rand(32, 1, 8, 8)
    y = torch.randint(0, 10, (32,))
    model = cnn(10)

    def fit(chunk: int):  # type: ignore[no-untyped-def]
        def run():  # type: ignore[no-untyped-def]
            curv = make_curvature("diag", model, "classification", chunk_size=chunk)
            curv.update(model, x, y)
            return curv

        return run

    fit(4)()  # warm-up
    peaks = {c: alloc_peak(fit(c))[1] for c in (4, 8)}
    per_sample = (peaks[8] - peaks[4]) / 4
    run = chain_forward(module_chain(model), x)
    modelled = backward_peak(run, 9, {0, 2, 6}, structured=True) * x.element_size()
    assert modelled == 3 * 9 * 1024 * 4
    assert per_sample <= 1.02 * modelled, (per_sample, modelled)
