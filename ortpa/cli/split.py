"""``ortpa split``: a paged model -> a stage folder (pipeline stages by layers, each with its own weights)."""

from __future__ import annotations

import argparse
import json

from ortpa.cli._common import COMMANDS, EXIT_OK, add_common

__all__ = ["print_split", "register", "run"]


def print_split(result, as_json: bool) -> None:
    """One line per stage (or JSON): layers, weights, what crosses into it, and the proof's figures."""
    m = result.manifest
    stages = [
        {
            "stage": s.index,
            "layers": [s.first_layer, s.stop_layer],
            "weight_bytes": s.weight_bytes,
            "receives": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in s.boundary_in],
            "caches": list(s.cache_inputs),
            "files": [f.name for f in s.files],
        }
        for s in m.stages
    ]
    proof = result.proof
    if as_json:
        figures = (
            None if proof is None else {"max_error": proof.max_error, "bound": proof.bound, "tokens": proof.tokens}
        )
        print(json.dumps({"folder": str(result.folder), "stages": stages, "proof": figures}))
        return
    for s in stages:
        got = ", ".join(f"{t['name']} {t['dtype']}{t['shape']}" for t in s["receives"]) or "input_ids"
        print(
            f"stage {s['stage']}: layers {s['layers'][0]}..{s['layers'][1] - 1}, "
            f"{s['weight_bytes'] / 1e6:.1f} MB of weights, receives {got}"
        )
    check = (
        "not verified (--no-verify)"
        if proof is None
        else f"verified: the stages reproduce the unsplit model (max |d| / scale {proof.max_error:.1e} <= "
        f"{proof.bound:.1e}, {proof.tokens} greedy tokens equal)"
    )
    print(f"wrote {result.folder}: {len(stages)} stages; {check}")


def run(args: argparse.Namespace) -> int:
    from ortpa.stages import split_model

    result = split_model(args.model, args.out, args.stages, verify=not args.no_verify)
    print_split(result, args.json)
    return EXIT_OK


def register(sub) -> None:
    p = sub.add_parser(
        "split",
        help=COMMANDS["split"],
        description="Split a converted (paged) model by layers into N pipeline stages: a folder with stages.json and "
        "one ONNX file per stage holding only its own weights. Stages are balanced by weight bytes, cut where one "
        "token value (the residual stream) carries everything the later layers read, and proven: the chain of "
        "stages must reproduce the unsplit model's logits and greedy tokens, or nothing is written. Run the folder "
        "with `ortpa generate` / `ortpa serve` (each stage a Ray actor: docs/distributed.md).",
    )
    p.add_argument("model", help="a converted model (.onnx), e.g. from `ortpa convert`")
    p.add_argument("out", help="the stage folder to write (new, or empty)")
    p.add_argument("--stages", type=int, required=True, help="number of stages (1 to the number of layers)")
    p.add_argument("--no-verify", action="store_true", help="skip the proof against the unsplit model")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_common(p)
    p.set_defaults(func=run)
