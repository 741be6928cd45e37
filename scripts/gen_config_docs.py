"""Write docs/config.md from the config's pydantic models (broker/config/config_reference.py), and the
recipe and rule tables of docs/algorithms.md from broker/config/config_recipes.py and config_rules.py.

python scripts/gen_config_docs.py           # rewrite them
python scripts/gen_config_docs.py --check   # exit 1 if one is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rollflash.broker.config.config_reference import markdown
from rollflash.broker.config.config_rules import with_algorithms_block

DOCS = Path(__file__).resolve().parents[1] / "docs"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a file is stale")
    args = parser.parse_args()
    algorithms = DOCS / "algorithms.md"
    wanted = {
        DOCS / "config.md": markdown(),
        algorithms: with_algorithms_block(algorithms.read_text()),
    }
    stale = [
        path for path, text in wanted.items() if not path.is_file() or path.read_text() != text
    ]
    if args.check:
        for path in stale:
            print(f"{path} is stale: run python scripts/gen_config_docs.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path])
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
