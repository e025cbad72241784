"""The verification rule's margin: the smallest defects it still catches against the largest error it accepts.

For each model (fixtures with the feature each defect needs), the original's greedy run is computed once; each
defect, at decreasing sizes, is injected (:mod:`ortpa.testing.defects`) and judged by the one rule
(:func:`ortpa.parity.verify.run_rule`, what ``convert`` and ``ortpa parity`` run). Printed as a Markdown table:
the structure error relative to its bound (caught when > 1) and the deployed model's next-token KL.

    python scripts/defect_margin.py [--quick] [--dtype float16] [--portable] [MODEL ...]

``--dtype float16``: the conversions are ``dtype=float16`` ones (a float32 original's twin then computes in float32
from its weights rounded to float16, :func:`ortpa.parity.twin.rounded_original`). ``--portable``: the judged files
are lowered (``convert --portable``; a defect is injected before the lowering, as ``convert`` lowers what it
verified), their float32 twin is the file upcast.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import onnx

from ortpa.conversion import convert_file
from ortpa.deploy.portable_file import lower_file
from ortpa.parity.greedy import dense_greedy, open_dense
from ortpa.parity.verify import _BLOCK_SIZE, run_rule, verification_prompts
from ortpa.testing import defects

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
CASES = {
    "llama_sdpa_op18": [
        ("scale", [1.1, 1.01, 1.001, 1.0001]),
        ("rope_base", [2.0, 1.1, 1.01, 1.001]),
        ("heads", [1]),
        ("norm_eps", [100.0, 10.0, 3.0]),
        ("cache_position", [1]),
    ],
    "dsv3_sdpa_op18": [("scale", [1.1, 1.01, 1.001, 1.0001]), ("heads", [1]), ("cache_position", [1])],
    "qwen2_sliding_sdpa_op18": [("window", [-1, 1])],
    "gemma2_eager_op18": [("softcap", [0.0, 0.99, 0.999])],
    "formats/genai_gptoss_fp32": [("sink", [0.0, 0.9, 0.99])],
    # computes in float16 itself: the float32 twins of both sides (ortpa.parity.upcast)
    "formats/genai_llama_fp16": [
        ("scale", [1.1, 1.01, 1.001, 1.0001]),
        ("rope_base", [2.0, 1.01, 1.001]),
        ("heads", [1]),
        ("cache_position", [1]),
    ],
}


def _row(name: str, defect: str, amount, verdict) -> str:
    s, p = verdict.structure, verdict.precision
    ratio = s.max_relative_error / s.tolerance
    caught = "refused" if not verdict.ok else "ACCEPTED"
    return (
        f"| {name} | {defect} | {amount} | {s.max_relative_error:.2e} | {s.tolerance:.2e} | {ratio:.3g} | "
        f"{p.kl_max:.2e} | {caught} |"
    )


def main(quick: bool = False, only: list[str] | None = None, dtype: str | None = None, portable: bool = False) -> None:
    kw = {"dtype": dtype} if dtype else {}
    suffix = "".join(f" ({w})" for w in (dtype, "portable" if portable else None) if w)
    print("| model | defect | amount | structure max |d|/scale | bound | ratio | deployed KL max | verdict |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, table in CASES.items():
            if only and name not in only:
                continue
            original = FIXTURES / f"{name}.onnx"
            folder = Path(tmp) / name.replace("/", "_")
            good = folder / "good" / "paged.onnx"
            convert_file(original, good, verify=False, **kw)
            judged = good
            if portable:  # the defects go into the PagedAttention nodes, then the file is lowered
                judged = folder / "portable" / "paged.onnx"
                convert_file(original, judged, verify=False, portable=True, **kw)
            dense = open_dense(original)
            prompts = verification_prompts(dense.thresholds)
            want = dense_greedy(dense.session, prompts, 3, interface=dense.interface)
            del dense
            blocks = sum(-(-(len(p) + 3) // _BLOCK_SIZE) for p in prompts) + 1
            verdict, _ = run_rule(original, judged, prompts, want, blocks)
            print(_row(name + suffix, "none", "-", verdict))
            for defect, amounts in table:
                for amount in amounts[:2] if quick else amounts:
                    bad = folder / f"{defect}_{amount}" / "paged.onnx"
                    bad.parent.mkdir(parents=True)
                    try:
                        if defect in defects.ORIGINAL_DEFECTS:
                            bad_original = bad.parent / "original.onnx"
                            onnx.save(defects.inject(defect, onnx.load(str(original)), amount), str(bad_original))
                            convert_file(bad_original, bad, verify=False, portable=portable, **kw)
                        else:
                            onnx.save(defects.inject(defect, onnx.load(str(good)), amount), str(bad))
                            if portable:
                                lower_file(bad)
                    except defects.DefectNotApplicable as exc:
                        print(f"| {name} | {defect} | {amount} | n/a: {exc} | | | | |")
                        break
                    verdict, _ = run_rule(original, bad, prompts, want, blocks)
                    print(_row(name + suffix, defect, amount, verdict), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    dtype = args[args.index("--dtype") + 1] if "--dtype" in args else None
    names = [a for a in args if not a.startswith("--") and a != dtype]
    main(quick="--quick" in args, only=names, dtype=dtype, portable="--portable" in args)
