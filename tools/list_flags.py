"""Prints the user-guide section of command-line flags (Markdown), generated from the configs.

Usage: python tools/list_flags.py > docs/flags.md
"""

import os
import sys

# Runnable from a checkout without installing: put the repository root on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.arguments import flags_markdown  # noqa: E402


def main() -> None:
    sys.stdout.write(flags_markdown())


if __name__ == "__main__":
    main()
