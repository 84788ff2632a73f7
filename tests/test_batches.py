"""Batches from tuples, DataLoaders of pairs and Hugging Face style dict batches."""

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import gaussify as gs
from gaussify.batches import DictBatches, as_batches, num_examples


class _DictSet(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor, keys: tuple[str, str]) -> None:
        self.x, self.y, self.keys = x, y, keys

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {self.keys[0]: self.x[i], self.keys[1]: self.y[i], "attention_mask": self.x[i]}


def _problem() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(40, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (40,))
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    return model.double(), x, y


def test_dict_batches_give_the_same_posterior_as_tensor_pairs() -> None:
    model, x, y = _problem()
    ref = gs.Laplace(model, "classification", "full").fit((x, y), batch_size=16)
    loader = DataLoader(_DictSet(x, y, ("input_ids", "labels")), batch_size=16)
    la = gs.Laplace(model, "classification", "full").fit(loader)
    torch.testing.assert_close(la.posterior_precision, ref.posterior_precision)
    torch.testing.assert_close(la.log_marginal_likelihood(), ref.log_marginal_likelihood())
    custom = DataLoader(_DictSet(x, y, ("pixel_values", "target")), batch_size=7)
    la2 = gs.Laplace(model, "classification", "full")
    la2.fit(DictBatches(custom, input_key="pixel_values", label_key="target"))
    torch.testing.assert_close(la2.posterior_precision, ref.posterior_precision)
    assert num_examples(DictBatches(custom, "pixel_values", "target")) == 40


def test_pair_loaders_pass_through_and_bad_batches_are_named() -> None:
    _, x, y = _problem()
    pairs = list(as_batches(DataLoader(list(zip(x, y, strict=True)), batch_size=10)))
    assert len(pairs) == 4
    torch.testing.assert_close(torch.cat([p[0] for p in pairs]), x)
    loader = DataLoader(_DictSet(x, y, ("pixel_values", "target")), batch_size=8)
    with pytest.raises(KeyError, match="input_ids"):
        next(iter(as_batches(loader)))
    with pytest.raises(TypeError, match="data"):
        next(iter(as_batches([torch.zeros(3)])))
    with pytest.raises(ValueError, match="rows"):
        next(iter(as_batches([(torch.zeros(3, 2), torch.zeros(4))])))


def _loaders(x: torch.Tensor, y: torch.Tensor) -> list[tuple[str, DataLoader]]:
    """Loaders over (x, y), built afresh per call (the seeded ones hold their generator)."""
    from torch.utils.data import BatchSampler, RandomSampler, TensorDataset

    ds = TensorDataset(x, y)
    return [
        ("sequential", DataLoader(ds, batch_size=16)),
        ("drop_last", DataLoader(ds, batch_size=16, drop_last=True)),
        ("one_batch", DataLoader(ds, batch_size=64)),
        ("shuffle_seeded", DataLoader(ds, batch_size=7, shuffle=True,
                                      generator=torch.Generator().manual_seed(3))),
        ("shuffle_global", DataLoader(ds, batch_size=7, shuffle=True)),
        ("batch_sampler", DataLoader(ds, batch_sampler=BatchSampler(
            RandomSampler(ds, generator=torch.Generator().manual_seed(5)), 9, False))),
    ]  # fmt: skip


def test_a_tensor_dataset_loader_gives_its_own_batches_without_per_row_indexing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plain DataLoader over a TensorDataset is read by indexing its tensors once per
    batch: the same batches (values, dtypes, shapes, fresh contiguous tensors) as iterating
    the loader, the samplers' and the global random streams advanced alike (the loader's
    base seed), and no TensorDataset.__getitem__ call (main indexed every row)."""
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, 2, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (40,), generator=g)
    calls: list[int] = []
    original = TensorDataset.__getitem__

    def counted(self: TensorDataset, i: int) -> tuple[torch.Tensor, ...]:
        calls.append(i)
        return original(self, i)

    for (name, loader), (_, again) in zip(_loaders(x, y), _loaders(x, y), strict=True):
        torch.manual_seed(1)
        want = [(bx.clone(), by.clone()) for bx, by in loader]
        after = torch.randn(3)
        torch.manual_seed(1)
        calls.clear()
        monkeypatch.setattr(TensorDataset, "__getitem__", counted)
        got = list(as_batches(again))
        monkeypatch.undo()
        assert calls == [], name
        torch.testing.assert_close(torch.randn(3), after, rtol=0, atol=0, msg=name)
        assert len(got) == len(want), name
        for (gx, gy), (wx, wy) in zip(got, want, strict=True):
            assert gx.dtype == wx.dtype and gy.dtype == wy.dtype, name
            assert gx.is_contiguous() and gx.data_ptr() != x.data_ptr(), name
            torch.testing.assert_close(gx, wx, rtol=0, atol=0, msg=name)
            torch.testing.assert_close(gy, wy, rtol=0, atol=0, msg=name)


def test_other_loaders_are_iterated_as_they_are() -> None:
    """A custom collate function, a dataset of more than two tensors or a loader subclass
    keep the loader's own iteration (its collate function is called)."""
    from torch.utils.data import TensorDataset, default_collate

    x, y = torch.randn(8, 2), torch.arange(8)
    seen = []

    def collate(rows):  # type: ignore[no-untyped-def]
        seen.append(len(rows))
        return default_collate(rows)

    got = list(as_batches(DataLoader(TensorDataset(x, y), batch_size=3, collate_fn=collate)))
    assert seen == [3, 3, 2] and torch.equal(got[2][1], y[6:])

    class Loader(DataLoader):
        def __iter__(self):  # type: ignore[no-untyped-def]
            seen.append("own")
            return super().__iter__()

    list(as_batches(Loader(TensorDataset(x, y), batch_size=4)))
    assert seen[-1] == "own"
    with pytest.raises(TypeError, match="expected batches of"):
        list(as_batches(DataLoader(TensorDataset(x, y, y), batch_size=4)))
