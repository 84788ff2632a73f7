"""The saved state of a :class:`~gaussify.weight_space.laplace.Laplace` posterior.

``state_dict`` holds tensors and plain values only (``torch.load(..., weights_only=True)``
reads it) and names what it belongs to: the task, the structure, the parameter tensors (and
subnetwork indices) of the subset, theta* and a fingerprint of the whole network
(:func:`gaussify.state.model_fingerprint`). ``load_state_dict`` checks all of it against the
receiving posterior and its model with the shared schema of :mod:`gaussify.state` before it
assigns anything.
"""

from __future__ import annotations

from typing import Any

from gaussify import state as st
from gaussify.curvature import make_curvature
from gaussify.likelihoods import get_likelihood
from gaussify.state import copy_state
from gaussify.weight_space.laplace_fields import LaplaceFields

__all__ = ["laplace_state_dict", "load_laplace_state"]


def laplace_state_dict(la: LaplaceFields) -> dict[str, Any]:
    """Everything needed to restore the fitted posterior, with its identity."""
    state: dict[str, Any] = {
        "task": la.task,
        "structure": la.structure,
        "subset": list(la.subset.names),
        "mean": la.mean,
        "theta_star": la.theta_star,
        "prior_precision": la.prior_precision,
        "prior_mean": la.prior_mean,
        "sigma_noise": la.sigma_noise,
        "sigma_fit": la._sigma_fit,
        "temperature": la.temperature,
        "num_data": la.num_data,
        "log_lik": la._log_lik,
        "grad": la._grad,
        "curvature": la._curvature.state_dict(),
        "model_fingerprint": st.model_fingerprint(la.model),
    }
    if la._sse is not None:
        state["sse"] = la._sse
    if la.subset.indices is not None:
        state["subset_indices"] = la.subset.indices
    return copy_state(state)


def _schema(la: LaplaceFields, curvature: Any) -> dict[str, Any]:
    dt = la._dtype
    schema: dict[str, Any] = {
        "task": st.Maybe(st.Choice((la.task,), "the task of this posterior")),
        "structure": st.Choice((la.structure,), "the structure of this posterior"),
        "subset": st.Names(tuple(la.subset.names)),
        "mean": st.TensorSpec(("P",), dt),
        "theta_star": st.TensorSpec(("P",), dt),
        "prior_precision": st.TensorSpec(None, dt, positive=True),
        "prior_mean": st.Maybe(st.TensorSpec(None, dt)),
        "sigma_noise": st.TensorSpec(None, dt, positive=True),
        "sigma_fit": st.TensorSpec(None, dt, positive=True),
        "temperature": st.Number(),
        "num_data": st.Integer(1),
        "log_lik": st.TensorSpec((), dt),
        "grad": st.TensorSpec(("P",), dt),
        "curvature": st.Nested(curvature.state_schema()),
        "model_fingerprint": st.Maybe(st.TensorSpec((None, 3), None)),
    }
    if la.task == "regression":  # the sum of squared residuals per output
        schema["sse"] = st.TensorSpec((None,), dt, nonnegative=True)
    if la.subset.indices is not None:
        schema["subset_indices"] = st.TensorSpec(("P",), "int")
    return schema


def load_laplace_state(la: LaplaceFields, state: dict[str, Any], *, strict: bool = True) -> None:
    """Validate ``state`` as a whole (keys, task, structure, subset, shapes, dtypes, NaN,
    theta* and the network's other weights against ``la.model``; ``strict=False`` turns the
    weight mismatch into a warning), then assign. A failed load changes nothing."""
    curvature = make_curvature(
        la.structure, la.model, la.likelihood, la.subset, **la.curvature_options
    )
    schema = _schema(la, curvature)
    if isinstance(state, dict) and "subset_indices" in state and la.subset.indices is None:
        raise st.StateError(
            "Laplace.load_state_dict: 'subset_indices': the state was saved for a different "
            f"subnetwork ({len(state['subset_indices'])} individual weights); this posterior "
            "covers whole parameter tensors"
        )
    valid = st.validate_state(state, schema, owner="Laplace", dims={"P": la.subset.num_params})
    if la.subset.indices is not None and not (valid["subset_indices"] == la.subset.indices).all():
        raise st.StateError(
            "Laplace.load_state_dict: 'subset_indices': the state was saved for a different "
            "subnetwork of individual weights"
        )
    st.require_task(state, la.task, "Laplace")
    current = la.subset.flatten(la.subset.params(la.model))
    st.check_weights(valid["theta_star"], current, owner="Laplace", strict=strict)
    st.check_fingerprint(valid.get("model_fingerprint"), la.model, owner="Laplace", strict=strict)
    curvature.load_state_dict(state["curvature"])
    # assignments (each setter validates granularity; la.load_state_dict is a transaction)
    la.prior_precision, la.sigma_noise = valid["prior_precision"], valid["sigma_noise"]
    la.prior_mean = valid.get("prior_mean", 0.0)
    la.temperature = valid["temperature"]
    la._curvature = curvature
    la.mean, la.theta_star = valid["mean"].clone(), valid["theta_star"].clone()
    la._sigma_fit = valid["sigma_fit"].clone()
    la.num_data = valid["num_data"]
    la._log_lik, la._grad = valid["log_lik"].clone(), valid["grad"].clone()
    la._sse = valid["sse"].clone() if "sse" in valid else None
    if la.task == "regression":
        la.likelihood = get_likelihood("regression", sigma_noise=la.sigma_noise)
    la._posterior = None
