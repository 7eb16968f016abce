"""Prints the user-guide section of command-line flags (Markdown), generated from the configs.

Usage:
    python tools/list_flags.py                   # print it
    python tools/list_flags.py --update-readme   # rewrite README.md's flag list in place
"""

import os
import sys

# Runnable from a checkout without installing: put the repository root on the path.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.training.arguments import flags_markdown  # noqa: E402

README_HEADING = "### Command-line flags"


def readme_section() -> str:
    """The flag list as README.md embeds it: one heading level deeper."""
    return flags_markdown().replace("## Command-line flags", README_HEADING).replace("\n### ", "\n#### ")


def update_readme(path: str = os.path.join(ROOT, "README.md")) -> None:
    with open(path) as f:
        text = f.read()
    start = text.index(README_HEADING)  # the flag list runs to the end of the README
    with open(path, "w") as f:
        f.write(text[:start] + readme_section())


def main() -> None:
    if "--update-readme" in sys.argv[1:]:
        update_readme()
    else:
        sys.stdout.write(flags_markdown())


if __name__ == "__main__":
    main()
