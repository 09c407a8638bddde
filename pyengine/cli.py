"""The ``pyengine`` command."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from . import __version__


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="pyengine", description=__doc__)
    parser.add_argument("--version", action="version", version=f"pyengine {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the checkpointed input gate in every mode and check its snapshots")
    demo.add_argument("--channels", type=int, default=4, help="upstream channels (default 4)")
    demo.add_argument("--buffers", type=int, default=4000, help="buffers per channel (default 4000)")
    demo.add_argument("--checkpoints", type=int, default=5, help="checkpoints per run (default 5)")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from . import demo as demo_module

        if args.channels < 1 or args.buffers < 1 or args.checkpoints < 1:
            parser.error("--channels, --buffers and --checkpoints must be >= 1")
        if args.buffers < 2 * args.checkpoints:
            parser.error(f"--buffers must be at least twice --checkpoints ({2 * args.checkpoints})")
        ok = demo_module.run(sys.stdout, args.channels, args.buffers, args.checkpoints)
        return 0 if ok else 1
    return 2  # pragma: no cover - argparse enforces a command


if __name__ == "__main__":
    sys.exit(main())
