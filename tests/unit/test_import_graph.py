"""The product's import graph (scripts/import_graph.py): no circle, no import against the layers;
and the checker itself fails on a circle and on a breach introduced into a tiny tree."""

from __future__ import annotations

import configparser
import textwrap
from pathlib import Path

from scripts.import_graph import ROOT, edges, modules, package_dirs, problems

SETUP_CFG = """\
[options]
package_dir =
    rollflash.algos = algos
    rollflash.envs = envs
    rollflash.learner = learner
    rollflash.generators = generators
    rollflash.rollctl = rollctl
"""


def _tree(root: Path, files: dict[str, str]) -> Path:
    """A product tree under `root`: setup.cfg's mapping and the given files (each folder of the
    mapping gets an __init__.py); returns its setup.cfg."""
    (root / "setup.cfg").write_text(SETUP_CFG)
    for folder in (
        "rollflash",
        "algos",
        "envs",
        "learner",
        "learner/step",
        "generators",
        "rollctl",
    ):
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "__init__.py").write_text("")
    for name, text in files.items():
        (root / name).write_text(textwrap.dedent(text))
    return root / "setup.cfg"


CLEAN = {
    "algos/loss.py": "import torch\n",
    "envs/task.py": "from rollflash.errors import BadInput\n",
    "rollflash/errors.py": "class BadInput(ValueError): ...\n",
    "learner/loop.py": "from rollflash.algos.loss import torch\nfrom .step import batch\n",
    "learner/step/batch.py": "from ...envs import task\n",
    "generators/rollout.py": "import rollflash.envs.task\n",
    "rollctl/cli.py": "from rollflash.learner import loop\nfrom rollflash.generators import rollout\n",
}


def test_the_product_has_no_import_circle_and_keeps_its_layers():
    assert problems(ROOT / "setup.cfg") == []


def test_the_products_graph_is_read_through_setup_cfg():
    known = modules(package_dirs(ROOT / "setup.cfg"))
    # sub-packages are found under their folder's mapping, and their imports become edges
    assert known["rollflash.learner.step.batch"] == ROOT / "learner" / "step" / "batch.py"
    found = {(e.source, e.target) for e in edges(known)}
    assert ("rollflash.learner.loop", "rollflash.learner.build") in found
    assert ("rollflash.envs.reward_functions", "rollflash.envs.scored") in found


def test_a_clean_tree_passes_and_relative_imports_resolve(tmp_path):
    setup_cfg = _tree(tmp_path, CLEAN)
    assert problems(setup_cfg) == []
    found = {(e.source, e.target) for e in edges(modules(package_dirs(setup_cfg)))}
    # `from .step import batch` in learner/loop.py; `from ...envs import task` two levels up
    assert ("rollflash.learner.loop", "rollflash.learner.step.batch") in found
    assert ("rollflash.learner.step.batch", "rollflash.envs.task") in found


def test_an_introduced_circle_fails_even_when_one_side_imports_lazily(tmp_path):
    files = {
        **CLEAN,
        "envs/a.py": "from rollflash.envs.b import g\n",
        "envs/b.py": "def g():\n    from rollflash.envs import a\n",
    }
    assert problems(_tree(tmp_path, files)) == [
        "import circle: rollflash.envs.a -> rollflash.envs.b -> rollflash.envs.a"
    ]


def test_a_circle_through_a_type_only_import_fails(tmp_path):
    files = {
        **CLEAN,
        "learner/step/batch.py": """\
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from rollflash.learner.loop import Loop
        """,
    }
    assert problems(_tree(tmp_path, files)) == [
        "import circle: rollflash.learner.loop -> rollflash.learner.step.batch"
        " -> rollflash.learner.loop"
    ]


def test_imports_against_the_layers_fail_one_line_each(tmp_path):
    files = {
        **CLEAN,
        "algos/loss.py": "import torch\nfrom rollflash.envs import task\n",
        "envs/task.py": "from rollflash.learner.step.batch import x\n",
        "generators/rollout.py": "import rollflash.learner.loop\n",
        "learner/loop.py": "from rollflash.rollctl.cli import main\n",
    }
    setup_cfg = _tree(tmp_path, files)
    found = problems(setup_cfg)
    breaches = sorted(line.split(": ", 1)[1] for line in found if not line.startswith("import"))
    assert breaches == [
        "rollflash.algos.loss imports rollflash.envs.task (algos/ may import no other folder: "
        "pure tensor math: torch only)",
        "rollflash.envs.task imports rollflash.learner.step.batch (envs/ may import no other "
        "folder: tasks and rewards: the stdlib, no torch)",
        "rollflash.generators.rollout imports rollflash.learner.loop (generators/ may import "
        "envs/, broker/: never the learner: they meet only through broker/)",
        "rollflash.learner.loop imports rollflash.rollctl.cli (learner/ may import algos/, "
        "broker/, envs/: never the generators: they meet only through broker/)",
    ]
    # each line names the file and line of the import
    assert f"{tmp_path / 'learner' / 'loop.py'}:1: rollflash.learner.loop imports" in "\n".join(
        found
    )


def test_setup_cfg_installs_every_sub_package():
    """A sub-package missing from setup.cfg's `packages` would be left out of a wheel while the
    editable install still finds it."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    found = {
        name
        for name, path in modules(package_dirs(ROOT / "setup.cfg")).items()
        if path.name == "__init__.py"
    }
    assert found == listed
