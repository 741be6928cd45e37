"""Write docs/config.md from the config's pydantic models (broker/config_reference.py).

python scripts/gen_config_docs.py           # rewrite docs/config.md
python scripts/gen_config_docs.py --check   # exit 1 if docs/config.md is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rollflash.broker.config_reference import markdown

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the file is stale")
    args = parser.parse_args()
    text = markdown()
    if args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC} is stale: run python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
