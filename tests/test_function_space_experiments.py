"""Pieces of the function-space experiments (issue 7, item 7) checked against exact references."""

import torch

import gaussify as gs
from gaussify.experiments.function_space_images import demo_function_space, rotate


def test_rotation_is_exact_for_quarter_turns_and_close_to_them_by_interpolation() -> None:
    torch.manual_seed(0)
    x = torch.rand(3, 784, dtype=torch.float64)
    torch.testing.assert_close(rotate(x, 0), x)
    torch.testing.assert_close(rotate(rotate(rotate(rotate(x, 90), 90), 90), 90), x)
    img = x.reshape(3, 1, 28, 28)
    torch.testing.assert_close(rotate(img, 180), img.flip(-1).flip(-2))
    # the bilinear path at an angle a hair away from 90 degrees approaches the exact rot90
    near = rotate(x, 90.0001).reshape(3, 28, 28)[:, 4:24, 4:24]
    exact = rotate(x, 90).reshape(3, 28, 28)[:, 4:24, 4:24]
    torch.testing.assert_close(near, exact, atol=1e-3, rtol=0)


def test_demo_function_space_is_the_ella_probit_predictive() -> None:
    ds = gs.data.load("iris", seed=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    probs, info = demo_function_space(ds, model, num_landmarks=20, seed=0)
    ella = gs.ELLA(model, "classification", num_landmarks=20, seed=0).fit((ds.x_train, ds.y_train))
    ella.optimize_prior(method="grid")
    ref = ella.predict(ds.x_test, link="probit").probs
    torch.testing.assert_close(probs, ref)
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(probs)))
    assert info["method"] == "ELLA"
