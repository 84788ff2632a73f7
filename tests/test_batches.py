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
