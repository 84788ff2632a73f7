"""The ``gaussify`` command: ``gaussify datasets``, ``gaussify demo`` and ``gaussify experiment``.

Every argument is checked before any data set is read or any network trained (numbers while
parsing, the demo's data set and output folder right after; see :mod:`gaussify.cli_args`). An
error is one line, ``gaussify: error: ...``, with exit status 2; ``--debug`` shows the
traceback instead. ``gaussify demo`` refuses an ``--out`` folder that already holds its
``report.json`` or one of its figures unless ``--force``: the first run in a fresh folder (the
README's command) just works, a second run says what is there and how to replace it.

``gaussify demo`` trains a MAP network, turns it into Gaussians (Kronecker Laplace over all
weights, full Laplace over the last layer, a post-hoc VBLL head, ELLA) and scores each on the
test set, on shifted test sets and on an out-of-distribution set (:mod:`gaussify.demo`), so
that the table shows where each method helps and where it costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gaussify import data as gdata
from gaussify import metrics
from gaussify.cli_args import (
    ArgumentParser,
    UsageError,
    add_progress_argument,
    nonnegative_int,
    positive_float,
    positive_int,
    prepare_output_dir,
    run_reporting_errors,
)
from gaussify.demo import METRICS, evaluate, evaluation_sets
from gaussify.training import train_map
from gaussify.weight_space import Laplace

__all__ = ["main"]

DEMO_DATASET = "digits"
#: (report name, curvature structure, parameter subset) of the Laplace posteriors in the demo
DEMO_LAPLACE = (
    ("laplace-kron", "kron", "all"),
    ("laplace-ll-full", "full", "last_layer"),
)
#: the files ``gaussify demo`` writes into ``--out``
DEMO_OUTPUTS = ("report.json", "reliability.png", "shift.png", "ood.png")


def _datasets(_: argparse.Namespace) -> int:
    specs = [gdata.info(name) for name in gdata.list()]
    header = ("name", "task", "n", "d", "classes", "source", "licence")
    table = [header] + [
        (
            s.name + ("" if gdata.is_available(s.name) else " (not installed)"),
            s.task,
            str(s.n),
            str(s.d),
            "-" if s.num_classes is None else str(s.num_classes),
            s.source,
            s.licence,
        )
        for s in specs
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:  # every cell in full; the last column is not padded
        cells = [cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=False)]
        print("  ".join([*cells, row[-1]]))
    print(f"\n{len(specs)} datasets; nothing is downloaded (see data/SOURCES.md).")
    return 0


def _mlp(d_in: int, d_out: int, width: int) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(d_in, width),
        nn.Tanh(),
        nn.Linear(width, width),
        nn.Tanh(),
        nn.Linear(width, d_out),
    )


def _check_demo(args: argparse.Namespace) -> Path:
    """Refuse a demo request before any work: the data set must be a known, installed
    classification set; ``--out`` must be a folder that can be created and written and does
    not already hold the demo's files (unless ``--force``). Returns the (created) folder."""
    if args.dataset not in gdata.REGISTRY:
        raise UsageError(
            f"argument --dataset: unknown data set {args.dataset!r}; {_demo_choices()}"
        )
    spec = gdata.info(args.dataset)
    if spec.task != "classification":
        raise UsageError(
            f"argument --dataset: {args.dataset!r} is a {spec.task} data set, the demo needs "
            f"a classification one; {_demo_choices()}"
        )
    if not gdata.is_available(args.dataset):
        gdata.load(args.dataset)  # raises the error that says how to install it
    return prepare_output_dir(args.out, "--out", DEMO_OUTPUTS, force=args.force)


def _demo_choices() -> str:
    return "choose one of " + ", ".join(gdata.list(task="classification", available_only=True))


def _demo(args: argparse.Namespace) -> int:
    out = _check_demo(args)
    # after the checks (matplotlib is slow to load) and before any work (a missing extra is
    # refused in one line naming the pip command)
    from gaussify.plots import plot_ood_histograms, plot_reliability, plot_shift

    replaced = [name for name in DEMO_OUTPUTS if (out / name).exists()]
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    ds = gdata.load(args.dataset, seed=args.seed)
    sets = evaluation_sets(ds, seed=args.seed)
    d_in = int(torch.tensor(ds.x_train.shape[1:]).prod())
    model = _mlp(d_in, ds.num_classes, args.width)
    print(
        f"gaussify demo: {ds.name} (n={ds.n}, d={ds.d}, classes={ds.num_classes}); "
        f"MLP {d_in}-{args.width}-{args.width}-{ds.num_classes}, MAP with prior precision "
        f"{args.prior_precision}"
    )
    _, history = train_map(
        model,
        (ds.x_train, ds.y_train),
        "classification",
        args.prior_precision,
        epochs=args.epochs,
        lr=args.lr,
        seed=args.seed,
        progress=args.progress,
    )
    # every method predicts on the test set, each shifted copy and the OOD set at once
    inputs = [ds.x_test, *sets.shifted, sets.ood]
    sizes = [x.shape[0] for x in inputs]
    x_all = torch.cat(inputs)
    probs: dict[str, Tensor] = {}
    with torch.no_grad():
        probs["map"] = torch.softmax(model(x_all), dim=-1)
    train = (ds.x_train, ds.y_train)
    hyper: dict[str, dict[str, float]] = {}
    for name, structure, subset in DEMO_LAPLACE:
        la = Laplace(model, "classification", structure, subset, args.prior_precision)
        la.fit(train, progress=args.progress).optimize_prior()
        pred = la.predict(x_all, method="glm", link="probit")
        assert pred.probs is not None
        probs[name] = pred.probs
        hyper[name] = {
            "prior_precision": float(la.prior_precision),
            "log_marginal_likelihood": float(la.log_marginal_likelihood()),
        }
    # the demo helpers predict on ``x_test``: hand them every evaluation input as the test set
    ds_all = dataclasses.replace(ds, x_test=x_all, y_test=torch.zeros(len(x_all), dtype=torch.long))

    from gaussify.experiments.vbll_classification import demo_vbll

    body = model[:-1]  # the MAP network without its output layer: the features of a VBLL head
    name, probs[name] = demo_vbll(
        ds_all, body, mode="posthoc", seed=args.seed, progress=args.progress
    )

    from gaussify.experiments.function_space_images import demo_function_space

    probs["ella"], _ = demo_function_space(ds_all, model, seed=args.seed)

    results, diagrams, entropies = {}, {}, {}
    for name, p in probs.items():
        test, *shifted, ood = torch.split(p, sizes)
        results[name] = evaluate(test, shifted, ood, ds.y_test)
        diagrams[name] = metrics.reliability_diagram(test, ds.y_test)
        entropies[name] = (metrics.predictive_entropy(test), metrics.predictive_entropy(ood))
    title = f"{ds.name} ({ds.x_test.shape[0]} test inputs)"
    figures = [
        plot_reliability(diagrams, out / "reliability.png", title=f"{title}: reliability"),
        plot_shift(
            {n: [r["in_distribution"], *r["by_strength"]] for n, r in results.items()},
            [0.0, *sets.strengths],
            out / "shift.png",
            xlabel=f"{sets.shift} ({sets.strength_name})",
            title=ds.name,
        ),
        plot_ood_histograms(
            entropies, out / "ood.png", title=f"{ds.name} test vs OOD: {sets.ood_name}"
        ),
    ]
    report = {
        "dataset": ds.name,
        "n_train": int(ds.x_train.shape[0]),
        "n_test": int(ds.x_test.shape[0]),
        "model": f"MLP {d_in}-{args.width}-{args.width}-{ds.num_classes} (tanh)",
        "prior_precision": args.prior_precision,
        "epochs": args.epochs,
        "seed": args.seed,
        "final_train_loss": history.loss[-1],
        "in_distribution": {n: r["in_distribution"] for n, r in results.items()},
        "shifted": {n: r["shifted"] for n, r in results.items()},
        "ood": {n: r["ood"] for n, r in results.items()},
        "shift": {
            "description": sets.shift,
            "strength": sets.strength_name,
            "strengths": list(sets.strengths),
            "by_strength": {n: r["by_strength"] for n, r in results.items()},
        },
        "ood_set": {"description": sets.ood_name, "n": int(sets.ood.shape[0])},
        "laplace": hyper,
        "figures": [str(f) for f in figures],
        "seconds": round(time.perf_counter() - start, 2),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print()
    print(_demo_table(report))
    note = f" (replaced the earlier {' and '.join(replaced)})" if replaced else ""
    written = ", ".join(str(out / name) for name in DEMO_OUTPUTS)
    print(f"\nwrote {written} in {report['seconds']} s{note}")
    return 0


def _demo_table(report: dict[str, Any]) -> str:
    """The printed table: one block per section, each headed by one line saying what it shows."""
    strengths = ", ".join(f"{s:g}" for s in report["shift"]["strengths"])
    heads = {
        "in_distribution": f"in-distribution: the {report['n_test']} {report['dataset']} test "
        "inputs (acc higher is better; NLL, ECE, Brier lower)",
        "shifted": f"shifted: {report['shift']['description']} by {strengths} "
        f"{report['shift']['strength']}, pooled (does confidence fall with accuracy?)",
        "ood": f"out-of-distribution: {report['ood_set']['description']}; AUROC of telling them "
        "from the test inputs by predictive entropy (1 perfect, 0.5 chance)",
    }
    lines = []
    for section, head in heads.items():
        keys = ("auroc",) if section == "ood" else METRICS
        lines += [head, f"  {'method':<18}" + "".join(f"{k:>9}" for k in keys)]
        for name, row in report[section].items():
            lines.append(f"  {name:<18}" + "".join(f"{row[k]:>9.4f}" for k in keys))
        lines.append("")
    return "\n".join(lines[:-1])


def _experiment(args: argparse.Namespace) -> int:
    from gaussify import experiments

    if args.name is None:
        print("gaussify experiment NAME [options]: reproduce a paper's table or figure\n")
        summaries = experiments.summaries()
        width = max(map(len, summaries))
        for name, summary in summaries.items():
            print(f"  {name.ljust(width)}  {summary}")
        print("\n'gaussify experiment NAME --help' lists the options of one experiment.")
        return 0
    rest = [a for a in args.rest if a != "--debug"]
    return int(experiments.get(args.name).main(rest))


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="gaussify", description="Gaussian approximate inference for deep learning."
    )
    debug_help = "show the traceback of an error instead of one line"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    p_data = sub.add_parser("datasets", parents=[common], help="list the bundled offline datasets")
    p_data.set_defaults(func=_datasets)
    p_demo = sub.add_parser(
        "demo",
        parents=[common],
        help="MAP, Laplace, VBLL and ELLA on a bundled dataset: in-distribution, shifted and "
        "out-of-distribution metrics, figures, JSON",
    )
    p_demo.add_argument("--dataset", default=DEMO_DATASET, help="a classification dataset name")
    p_demo.add_argument("--epochs", type=positive_int, default=60)
    p_demo.add_argument("--width", type=positive_int, default=50, help="hidden units (50)")
    p_demo.add_argument("--lr", type=positive_float, default=3e-3)
    p_demo.add_argument("--prior-precision", type=positive_float, default=1.0)
    p_demo.add_argument("--seed", type=nonnegative_int, default=0)
    p_demo.add_argument("--out", default="gaussify-demo", help="folder for report and figure")
    p_demo.add_argument(
        "--force", action="store_true", help="replace the report and figures in --out"
    )
    add_progress_argument(p_demo)
    p_demo.set_defaults(func=_demo)
    from gaussify.experiments import EXPERIMENTS

    p_exp = sub.add_parser(
        "experiment",
        help="reproduce a paper table or figure (no name: list them)",
        description="Reproduce a paper's table or figure; without a name, list the experiments.",
    )
    p_exp.add_argument("name", nargs="?", choices=EXPERIMENTS, help="omit to list them")
    p_exp.add_argument("rest", nargs=argparse.REMAINDER, help="the experiment's own options")
    p_exp.set_defaults(func=_experiment)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gaussify`` console script: the exit status (0 ok, 2 refused)."""
    args = _parser().parse_args(argv)
    debug = bool(args.debug) or (args.command == "experiment" and "--debug" in args.rest)
    return run_reporting_errors(lambda: args.func(args), debug=debug)


if __name__ == "__main__":
    sys.exit(main())
