"""Scale-out on ``torch.distributed``: every quantity gaussify accumulates over data is a sum.

With the data split into shards D_1, ..., D_K (one per rank), every statistic the library
accumulates is additive over examples,

    G = sum_n J_n^T Lambda_n J_n = sum_r G_r,    log p(D | theta*) = sum_r log p(D_r | theta*),

and the same holds for the diagonal GGN, the Kronecker factors A = sum a a^T, B = sum g g^T and
their sample counts, the empirical Fisher, the gradient J^T r, squared errors, ELLA's R x R
sufficient statistics and the information form (Lambda, eta) of a Bayesian last layer. One
``all_reduce(SUM)`` of the per-rank sums therefore gives every rank *the* single-process
result (up to the order of floating-point additions); everything computed from it afterwards
(posterior, evidence, prior tuning, predictive) is deterministic and needs no communication.

Nothing changes for a user besides sharding the data (a ``DistributedSampler``, or
:class:`ShardSampler` / :func:`shard`, which do not pad): when a process group is initialised
(``torchrun`` + :func:`init_process_group`, or ``torch.distributed.init_process_group``),
``Laplace.fit`` / ``refine``, ``ELLA.fit``, ``FunctionalLaplace.fit`` and
``ExactLastLayer.fit`` reduce across ranks through the functions of this module. Without a
process group (or inside :func:`local`) every function here is a no-op.

Failure handling: each reduction starts with a small status all-reduce (one slot per rank: a
failure flag and a checksum of the payload's shapes). A method decorated with
:func:`collective` that raises on one rank takes part in the status exchange of the pending
reduction with its failure flag set, so every other rank raises :class:`DistributedError`
naming the failing rank and its exception instead of waiting forever; ranks whose payloads
disagree (different models, a missing statistic) raise too. A rank that dies or never
arrives is caught by the process group's timeout (set by :func:`init_process_group`), which
is re-raised as :class:`DistributedError`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import Sampler

__all__ = [
    "CommStats",
    "DistributedError",
    "LastLayerSync",
    "ShardSampler",
    "all_gather_cat",
    "all_reduce_sum",
    "barrier",
    "broadcast",
    "collective",
    "comm_stats",
    "init_process_group",
    "is_distributed",
    "local",
    "print0",
    "rank",
    "reduce_curvature",
    "reduce_exact_last_layer",
    "reduce_state",
    "reset_comm_stats",
    "shard",
    "world_size",
]

P = ParamSpec("P")
R = TypeVar("R")

#: Seconds a failing rank waits for its peers to receive its failure flag.
FAILURE_SIGNAL_TIMEOUT_S = 30.0


class DistributedError(RuntimeError):
    """A collective could not complete: another rank failed, disagreed or did not arrive."""


# ----------------------------------------------------------------------------- state


@dataclass
class CommStats:
    """Time and volume spent in gaussify's collectives on this rank since the last reset.

    ``wait_s``: the status exchange that opens each reduction (it doubles as a barrier, so it
    holds the time spent waiting for slower ranks); ``comm_s``: the payload all-reduces,
    gathers and broadcasts after it (pure communication: every rank has arrived);
    ``bytes``: payload bytes this rank contributed; ``calls``: number of reductions.
    """

    wait_s: float = 0.0
    comm_s: float = 0.0
    bytes: int = 0
    calls: int = 0


class _Local(threading.local):
    depth = 0  # nesting of @collective regions
    disabled = 0  # nesting of local()


_STATE = _Local()
_STATS = CommStats()


def comm_stats() -> CommStats:
    """A copy of this rank's communication counters (see :class:`CommStats`)."""
    return copy.copy(_STATS)


def reset_comm_stats() -> None:
    """Zero this rank's communication counters."""
    global _STATS
    _STATS = CommStats()


def is_distributed() -> bool:
    """True when a process group with more than one rank is initialised (and not inside
    :func:`local`): only then do the reductions communicate."""
    return (
        _STATE.disabled == 0
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    )


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """Number of ranks (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@contextlib.contextmanager
def local() -> Iterator[None]:
    """Inside this block every reduction is a no-op: fits see only this rank's data (for
    per-rank models, or a rank-0-only evaluation while the others wait elsewhere)."""
    _STATE.disabled += 1
    try:
        yield
    finally:
        _STATE.disabled -= 1


def init_process_group(backend: str | None = None, *, timeout_s: float = 300.0) -> bool:
    """Initialise the default process group from the ``torchrun`` environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); return :func:`is_distributed`.

    ``backend``: "gloo" (CPU) or "nccl" (one GPU per rank; the rank's device is set from
    ``LOCAL_RANK``); default nccl when CUDA is available, else gloo. ``timeout_s`` bounds
    every collective: a rank that crashed or never arrives makes the others raise after at
    most this many seconds. Without ``WORLD_SIZE`` (a plain ``python`` run) nothing is
    initialised and False is returned, so one script serves both cases.
    """
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"timeout_s: must be a finite number > 0, got {timeout_s}")
    if dist.is_initialized():
        return is_distributed()
    if "WORLD_SIZE" not in os.environ:
        return False
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: expected 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return is_distributed()


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only (every rank prints without a process group)."""
    if rank() == 0:
        print(*args, **kwargs)


# ----------------------------------------------------------------------------- sharding


class ShardSampler(Sampler[int]):
    """Indices ``rank, rank + K, rank + 2K, ...`` of a dataset of ``num_examples``: every
    example on exactly one rank. Unlike ``torch.utils.data.DistributedSampler`` (which pads
    the shards to equal length by repeating examples, or drops the tail), nothing is
    duplicated or lost, so the reduced sums are exactly the single-process ones."""

    def __init__(
        self, num_examples: int, rank_: int | None = None, world_size_: int | None = None
    ) -> None:
        if isinstance(num_examples, bool) or not isinstance(num_examples, int):
            raise ValueError(f"num_examples: expected an integer >= 0, got {num_examples!r}")
        self.rank = rank() if rank_ is None else int(rank_)
        self.world_size = world_size() if world_size_ is None else int(world_size_)
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank_: expected 0 <= rank < {self.world_size}, got {self.rank}")
        self.num_examples = num_examples

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.num_examples, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.num_examples, self.world_size))


def shard(*tensors: Tensor) -> tuple[Tensor, ...]:
    """This rank's rows ``rank::world_size`` of each tensor (all with the same length N); the
    whole tensors without a process group. N need not be divisible by the world size."""
    if not tensors:
        raise ValueError("tensors: expected at least one tensor")
    n = tensors[0].shape[0]
    for i, t in enumerate(tensors):
        if t.shape[0] != n:
            raise ValueError(f"tensors: tensor {i} has {t.shape[0]} rows, the first has {n}")
    if not is_distributed():
        return tensors
    return tuple(t[rank() :: world_size()] for t in tensors)


# ----------------------------------------------------------------------------- error handling


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wrap(exc: Exception, what: str) -> DistributedError:
    return DistributedError(
        f"rank {rank()}: {what}: a collective failed ({type(exc).__name__}: {exc}); another "
        "rank most likely crashed or did not reach this point within the process group's "
        "timeout"
    )


@contextlib.contextmanager
def _communication(what: str) -> Iterator[None]:
    """One collective: its time and count go into the statistics; an exception other than a
    :class:`DistributedError` is re-raised as one naming ``what``."""
    start = time.perf_counter()
    try:
        yield
    except DistributedError:
        raise
    except Exception as exc:
        raise _wrap(exc, what) from exc
    finally:
        _STATS.comm_s += time.perf_counter() - start
        _STATS.calls += 1


def _exchange_status(what: str, signature: str, error: BaseException | None) -> None:
    """Open a reduction: all-reduce (failure flag, payload checksum) per rank, then raise on
    every rank if any rank failed or the payloads disagree."""
    k, me = dist.get_world_size(), dist.get_rank()
    status = torch.zeros(2, k, dtype=torch.int64, device=_comm_device())
    status[0, me] = int(error is not None)
    status[1, me] = zlib.crc32(f"{what}|{signature}".encode())
    start = time.perf_counter()
    try:
        if error is None:
            dist.all_reduce(status)
        else:
            work = dist.all_reduce(status, async_op=True)
            assert work is not None
            work.wait(timedelta(seconds=FAILURE_SIGNAL_TIMEOUT_S))
    except Exception as exc:
        if error is not None:
            return  # the peers are gone; the caller re-raises its own error
        raise _wrap(exc, what) from exc
    finally:
        _STATS.wait_s += time.perf_counter() - start
    status = status.cpu()
    failed = [r for r in range(k) if status[0, r] > 0]
    if failed:
        messages: list[Any] = [None] * k
        local_msg = None if error is None else f"{type(error).__name__}: {error}"
        try:
            dist.all_gather_object(messages, local_msg)
        except Exception as exc:
            if error is not None:
                return
            raise _wrap(exc, what) from exc
        if error is not None:
            return
        detail = "; ".join(f"rank {r}: {messages[r]}" for r in failed)
        raise DistributedError(
            f"rank {me}: {what}: rank(s) {failed} failed, so this collective was abandoned "
            f"on every rank ({detail})"
        )
    if error is not None:
        return
    if bool((status[1] != status[1, 0]).any()):
        sigs: list[Any] = [None] * k
        dist.all_gather_object(sigs, f"{what}: {signature}")
        detail = "; ".join(f"rank {r}: {s}" for r, s in enumerate(sigs))
        raise DistributedError(
            f"rank {me}: the ranks reduce different quantities ({detail}); every rank must "
            "run the same code on the same model with non-empty data"
        )


def collective(what: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator for a method that contains gaussify reductions: if it raises on one rank
    before its peers finished the pending reduction, the failure flag is sent, so every
    other rank raises :class:`DistributedError` (naming this rank and its exception) within a
    bounded time; the failing rank re-raises its own exception. Nested regions signal once."""

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            if not is_distributed():
                return fn(*args, **kwargs)
            _STATE.depth += 1
            try:
                return fn(*args, **kwargs)
            except DistributedError:
                raise
            except Exception as exc:
                if _STATE.depth == 1:
                    _exchange_status(what, "failed", exc)
                raise
            finally:
                _STATE.depth -= 1

        return wrapper

    return decorate


def barrier(timeout_s: float = 60.0, what: str = "barrier") -> None:
    """Wait for every rank; raise :class:`DistributedError` naming the ranks that did not
    arrive within ``timeout_s`` (``monitored_barrier`` on gloo, ``barrier`` otherwise)."""
    if not is_distributed():
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        else:
            dist.barrier()
    except Exception as exc:
        raise _wrap(exc, what) from exc


# ----------------------------------------------------------------------------- reductions

Value = Tensor | int | float | None


def _describe(values: tuple[Value, ...]) -> str:
    parts = []
    for v in values:
        if v is None:
            parts.append("None")
        elif isinstance(v, Tensor):
            parts.append(f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}")
        else:
            parts.append(type(v).__name__)
    return f"{len(values)} values [{', '.join(parts)}]"


def all_reduce_sum(*values: Value, what: str = "all_reduce_sum") -> Any:
    """Sum each value over ranks; every rank gets the same sums. Tensors come back as new
    tensors (detached, same dtype/device), Python ints/floats as ints/floats, None as None;
    one value in, one value out, else a tuple. The identity without a process group.

    All tensors of one dtype travel in one flat buffer (one all-reduce per dtype), after the
    status exchange of :func:`collective`."""
    if not is_distributed():
        return values[0] if len(values) == 1 else values
    _exchange_status(what, _describe(values), None)
    device = _comm_device()
    tensors: list[tuple[int, Tensor]] = []
    for i, v in enumerate(values):
        if isinstance(v, Tensor):
            tensors.append((i, v.detach()))
        elif isinstance(v, bool) or (v is not None and not isinstance(v, (int, float))):
            raise TypeError(f"values: expected tensors, ints, floats or None, got {type(v)}")
        elif isinstance(v, int):
            tensors.append((i, torch.tensor(v, dtype=torch.int64)))
        elif isinstance(v, float):
            tensors.append((i, torch.tensor(v, dtype=torch.float64)))
    out: list[Any] = list(values)
    by_dtype: dict[torch.dtype, list[tuple[int, Tensor]]] = {}
    for i, t in tensors:
        by_dtype.setdefault(t.dtype, []).append((i, t))
    with _communication(what):
        for dtype in sorted(by_dtype, key=str):
            group = by_dtype[dtype]
            flat = torch.cat([t.reshape(-1).to(device) for _, t in group])
            dist.all_reduce(flat)
            _STATS.bytes += flat.numel() * flat.element_size()
            for (i, t), part in zip(group, flat.split([t.numel() for _, t in group]), strict=True):
                reduced = part.reshape(t.shape).to(t.device)
                v = values[i]
                out[i] = reduced if isinstance(v, Tensor) else type(v)(reduced.item())
    return out[0] if len(out) == 1 else tuple(out)


def reduce_state(obj: Any, *, keys: Callable[[str], bool] | None = None, what: str = "") -> Any:
    """All-reduce the tensors of ``obj.state_dict()`` (those whose key passes ``keys``,
    default all) and load the sums back with ``obj.load_state_dict``: for objects whose
    state is a sum over data (full / diag GGN and EF, Kronecker factors and counts). Returns
    ``obj``. Only call it on additive states: a mean or an eigendecomposition summed over
    ranks is wrong (see :func:`reduce_curvature`)."""
    if not is_distributed():
        return obj
    state = obj.state_dict()
    names = [k for k, v in state.items() if isinstance(v, Tensor) and (keys is None or keys(k))]
    label = what or f"{type(obj).__name__}.state_dict"
    sums = all_reduce_sum(*[state[k] for k in names], what=label)
    sums = sums if isinstance(sums, tuple) else (sums,)
    new_state = dict(state)
    new_state.update(zip(names, sums, strict=True))
    obj.load_state_dict(new_state)
    return obj


#: Curvature structures whose whole state is a sum over data.
ADDITIVE_STRUCTURES = ("full", "diag", "kron")


def reduce_curvature(curvature: Any) -> Any:
    """Sum an accumulated curvature over ranks (full: G (P x P); diag: (P,); kron: every
    factor A, B and its sample count M; plus ``num_data``). The low-rank structure stores
    eigenpairs, which are not additive, and raises a ``ValueError``."""
    if not is_distributed():
        return curvature
    structure = getattr(curvature, "structure", None)
    if structure not in ADDITIVE_STRUCTURES:
        raise ValueError(
            f"structure: {structure!r} is not additive over data (its state is not a sum over "
            f"examples), so it cannot be reduced across ranks; use one of "
            f"{ADDITIVE_STRUCTURES} under torch.distributed"
        )
    return reduce_state(curvature, what=f"curvature ({structure})")


def all_gather_cat(*tensors: Tensor, what: str = "all_gather_cat") -> Any:
    """Concatenate each tensor along dim 0 over ranks in rank order (rank 0's rows first);
    shards may have different lengths. For methods that need every training point on every
    rank (the exact function-space GP). Identity without a process group."""
    if not is_distributed():
        return tensors[0] if len(tensors) == 1 else tensors
    rows = [int(t.shape[0]) for t in tensors]
    _exchange_status(what, _describe(tuple(t[:0] for t in tensors)), None)
    k, device = dist.get_world_size(), _comm_device()
    with _communication(what):
        counts = torch.zeros(k, len(tensors), dtype=torch.int64, device=device)
        counts[dist.get_rank()] = torch.tensor(rows, device=device)
        dist.all_reduce(counts)
        counts = counts.cpu()
        out = []
        for j, t in enumerate(tensors):
            top = int(counts[:, j].max())
            padded = t.new_zeros(top, *t.shape[1:], device=device)
            padded[: t.shape[0]] = t.detach().to(device)
            parts = [torch.empty_like(padded) for _ in range(k)]
            dist.all_gather(parts, padded)
            _STATS.bytes += padded.numel() * padded.element_size()
            out.append(
                torch.cat([p[: int(counts[r, j])] for r, p in enumerate(parts)]).to(t.device)
            )
    return out[0] if len(out) == 1 else tuple(out)


def broadcast(tensor: Tensor, src: int = 0, *, what: str = "broadcast") -> Tensor:
    """Rank ``src``'s ``tensor`` on every rank (shapes may differ before the call; dtype must
    agree). Identity without a process group."""
    if not is_distributed():
        return tensor
    _exchange_status(what, f"{tensor.dtype} ndim={tensor.ndim}", None)
    device = _comm_device()
    start = time.perf_counter()
    try:
        shape = torch.zeros(tensor.ndim, dtype=torch.int64, device=device)
        if dist.get_rank() == src:
            shape += torch.tensor(tensor.shape, dtype=torch.int64, device=device)
        dist.broadcast(shape, src)
        buf = (
            tensor.detach().to(device).contiguous()
            if dist.get_rank() == src
            else torch.empty(*shape.tolist(), dtype=tensor.dtype, device=device)
        )
        dist.broadcast(buf, src)
        _STATS.bytes += buf.numel() * buf.element_size()
    except Exception as exc:
        raise _wrap(exc, what) from exc
    finally:
        _STATS.comm_s += time.perf_counter() - start
        _STATS.calls += 1
    return buf.to(tensor.device)


# ----------------------------------------------------------------------------- last layer


def _information(mean: Tensor, cov: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(Lambda (K, D, D), eta (D, K), log Z (K,)) of per-column Gaussians N(mean[:, k], cov[k])
    with log Z = 1/2 eta^T Lambda^-1 eta - 1/2 log det Lambda (the log normaliser without the
    2 pi term, which cancels in :func:`reduce_exact_last_layer`)."""
    chol = torch.linalg.cholesky(0.5 * (cov + cov.mT))
    precision = torch.cholesky_inverse(chol)
    eta = (precision @ mean.T.unsqueeze(-1)).squeeze(-1).T
    # 1/2 eta^T Lambda^-1 eta = 1/2 mean^T Lambda mean; log det Lambda = -log det Sigma
    quad = (mean * eta).sum(0)
    logdet_cov = 2 * torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum(-1)
    return 0.5 * (precision + precision.mT), eta, 0.5 * quad + 0.5 * logdet_cov


def reduce_exact_last_layer(layer: Any, baseline: dict[str, Any] | None = None) -> Any:
    """Merge the posteriors of an ``ExactLastLayer`` conditioned on disjoint shards, in place;
    every rank ends with the posterior (and log evidence) of all the data. Returns ``layer``.

    ``baseline``: the layer's ``state_dict()`` when the ranks last agreed (default: the
    prior). Per column, each rank's posterior is the baseline times its shard's Gaussian
    pseudo-likelihood, so in information form (Lambda = Sigma^-1, eta = Lambda mu)

        Lambda = Lambda_0 + sum_r (Lambda_r - Lambda_0),   eta = eta_0 + sum_r (eta_r - eta_0),

    and with log Z(Lambda, eta) = 1/2 eta^T Lambda^-1 eta - 1/2 log det Lambda, the evidence of
    the union follows from the per-shard evidences L_r (chain rule, shards independent given
    the weights):

        L = L_0 + log Z - log Z_0 + sum_r (L_r - L_0 - log Z_r + log Z_0).

    ``streaming=False`` layers store additive sums (precision, eta, sum m^2/v, sum log 2 pi v)
    and are reduced as increments over the baseline directly.
    """
    if not is_distributed():
        return layer
    if baseline is None:
        baseline = copy.deepcopy(layer).reset().state_dict()
    state = layer.state_dict()
    k = dist.get_world_size()
    n_inc = int(state["num_data"]) - int(baseline["num_data"])
    if not state["streaming"]:
        keys = ("precision", "eta", "quad", "log_norm")
        incs = [state[key] - baseline[key] for key in keys]
        sums = all_reduce_sum(*incs, n_inc, what="ExactLastLayer (information form)")
        for key, inc in zip(keys, sums[:-1], strict=True):
            state[key] = baseline[key] + inc
        state["num_data"] = int(baseline["num_data"]) + sums[-1]
        layer.load_state_dict(state)
        return layer
    lam0, eta0, logz0 = _information(baseline["mean"], baseline["cov"])
    lam_r, eta_r, logz_r = _information(state["mean"], state["cov"])
    ev0 = baseline["log_evidence"]
    ev_inc = state["log_evidence"] - ev0 - logz_r.sum()
    dlam, deta, dev, dn = all_reduce_sum(
        lam_r - lam0, eta_r - eta0, ev_inc, n_inc, what="ExactLastLayer (streaming)"
    )
    lam, eta = lam0 + dlam, eta0 + deta
    chol = torch.linalg.cholesky(0.5 * (lam + lam.mT))
    cov = torch.cholesky_inverse(chol)
    mean = torch.cholesky_solve(eta.T.unsqueeze(-1), chol).squeeze(-1).T
    logz = 0.5 * (eta * mean).sum(0) - torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum(-1)
    state["mean"], state["cov"] = mean, 0.5 * (cov + cov.mT)
    state["log_evidence"] = ev0 + logz.sum() + dev + (k - 1) * logz0.sum()
    state["num_data"] = int(baseline["num_data"]) + dn
    layer.load_state_dict(state)
    return layer


class LastLayerSync:
    """Repeated merges of a streaming ``ExactLastLayer``: each rank calls ``layer.update`` on
    its own stream, and ``sync()`` (on every rank at the same point) merges what all ranks saw
    since the previous ``sync()`` (or since construction) by :func:`reduce_exact_last_layer`.
    """

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self._baseline = _snapshot(layer)

    def __call__(self) -> Any:
        return self.sync()

    def sync(self) -> Any:
        """Merge across ranks; returns the layer."""
        reduce_exact_last_layer(self.layer, self._baseline)
        self._baseline = _snapshot(self.layer)
        return self.layer


def _snapshot(layer: Any) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, Tensor) else v for k, v in layer.state_dict().items()}
