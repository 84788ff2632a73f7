"""The demo's evaluation sets and per-method numbers (``gaussify.demo``)."""

from __future__ import annotations

import math

import pytest
import torch

from gaussify import data, demo, metrics


def test_rotation_by_a_quarter_turn_is_the_pixel_permutation() -> None:
    images = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    # pixel centres map onto pixel centres: bilinear interpolation reproduces rot90 exactly
    assert torch.allclose(demo.rotate_images(images, 90.0), torch.rot90(images, 1, (-2, -1)))
    assert torch.allclose(demo.rotate_images(images, 0.0), images)
    with pytest.raises(ValueError, match=r"images: expected \(N, 1, H, W\), got \(3, 64\)"):
        demo.rotate_images(images.reshape(3, 64), 10.0)


def test_digits_sets_are_rotated_test_images_and_fashion_mnist_in_digit_units() -> None:
    ds = data.load("digits", seed=0)
    sets = demo.evaluation_sets(ds, seed=0)
    assert sets.strengths == demo.IMAGE_ANGLES and len(sets.shifted) == len(demo.IMAGE_ANGLES)
    pixels = ds.x_test * ds.x_std.float() + ds.x_mean.float()
    for angle, shifted in zip(sets.strengths, sets.shifted, strict=True):
        expected = demo.rotate_images(pixels.reshape(-1, 1, 8, 8), angle).reshape(-1, 64)
        back = shifted * ds.x_std.float() + ds.x_mean.float()
        assert torch.allclose(back, expected, atol=1e-4)
    # OOD: Fashion-MNIST images, each the 8 x 8 block average of a 28 x 28 image times 16
    assert sets.ood.shape == ds.x_test.shape and "fashion_mnist" in sets.ood_name
    ood_pixels = sets.ood * ds.x_std.float() + ds.x_mean.float()
    assert float(ood_pixels.min()) >= -1e-4 and float(ood_pixels.max()) <= 16 + 1e-4
    fashion = data.load("fashion_mnist", seed=0).x_test.reshape(-1, 1, 28, 28)
    pooled = torch.nn.functional.adaptive_avg_pool2d(fashion, 8).reshape(-1, 64) * 16
    distance = torch.cdist(ood_pixels[:5], pooled).min(dim=1).values
    assert torch.all(distance < 0.1)  # one of those images (float32 round trip of the units)
    again = demo.evaluation_sets(ds, seed=0)
    assert torch.equal(again.ood, sets.ood)  # seeded


def test_tabular_sets_add_noise_of_each_strength_and_permute_each_feature() -> None:
    ds = data.load("wine", seed=0)
    sets = demo.evaluation_sets(ds, seed=0)
    assert sets.strengths == demo.TABULAR_NOISE
    for s, shifted in zip(sets.strengths, sets.shifted, strict=True):
        noise = shifted - ds.x_test
        # standard deviation of N d normal draws: within 4 standard errors of s
        assert abs(float(noise.std()) - s) < 4 * s / math.sqrt(2 * noise.numel())
    # each OOD column holds exactly the test column's values, in another order
    assert torch.equal(sets.ood.sort(dim=0).values, ds.x_test.sort(dim=0).values)
    assert not torch.equal(sets.ood, ds.x_test)


def test_evaluate_pools_the_strengths_and_scores_ood_by_entropy() -> None:
    gen = torch.Generator().manual_seed(1)
    probs = [torch.softmax(torch.randn(20, 3, generator=gen), -1) for _ in range(4)]
    y = torch.randint(0, 3, (20,), generator=gen)
    result = demo.evaluate(probs[0], probs[1:3], probs[3], y)
    pooled = metrics.classification_metrics(torch.cat(probs[1:3]), torch.cat([y, y]))
    assert result["shifted"] == {k: pooled[k] for k in demo.METRICS}
    assert result["by_strength"][1]["nll"] == metrics.nll(probs[2], y)
    assert result["in_distribution"]["brier"] == metrics.brier(probs[0], y)
    assert result["ood"] == {"auroc": metrics.ood_auroc(probs[0], probs[3])}
