"""``ortpa doctor``: what this installation runs PagedAttention with (docs/native.md)."""

from __future__ import annotations

import argparse
import json

from ortpa.cli._common import COMMANDS, EXIT_OK

__all__ = ["register", "run"]


def run(args: argparse.Namespace) -> int:
    import onnxruntime as ort

    from ortpa import __version__
    from ortpa.ops.native import native_report

    native = native_report()
    report = {
        "ortpa": __version__,
        "onnxruntime": ort.__version__,
        "providers": ort.get_available_providers(),
        "native": native,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return EXIT_OK
    print(f"ortpa        {__version__}")
    print(f"onnxruntime  {ort.__version__} ({', '.join(report['providers'])})")
    if native["present"]:
        print(f"native CPU PagedAttention kernel: present, ISA path {native['isa']}")
        print(f"  library    {native['path']}")
    else:
        print(f"native CPU PagedAttention kernel: absent ({native['absent_reason']})")
    print(f"PagedAttention on CPU: {native['cpu_paged_attention']} (ORTPA_PAGED_ATTENTION={native['mode']})")
    return EXIT_OK


def register(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help=COMMANDS["doctor"],
        description="Report the onnxruntime version and providers, whether ortpa's native CPU PagedAttention "
        "library is present (its path and the instruction-set path its kernel takes on this machine, or why it is "
        "absent), and which implementation PagedAttention nodes get on the CPU provider.",
        epilog="example:\n  ortpa doctor --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=run)
