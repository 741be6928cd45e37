"""Every relative link of README.md and docs/*.md names a file that exists and, with a `#anchor`,
a heading of that file (GitHub's anchors: lower case, punctuation dropped, spaces to hyphens)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+)$", re.M)
FENCED = re.compile(r"^```.*?^```$", re.M | re.S)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_anchor_rules():
    # backticks, dots, colons, commas and slashes go; hyphens, underscores and spaces stay
    assert anchor("Pipeline (`scripts/bench_pipeline.py`)") == "pipeline-scriptsbench_pipelinepy"
    assert anchor("RLHF: reward model, KL control") == "rlhf-reward-model-kl-control"


def anchors(path: Path) -> set[str]:
    return {anchor(h) for h in HEADING.findall(FENCED.sub("", path.read_text()))}


def test_every_relative_link_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(FENCED.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            name, _, frag = target.partition("#")
            dest = (page.parent / name).resolve() if name else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
