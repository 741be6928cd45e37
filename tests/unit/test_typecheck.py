"""scripts/typecheck.py names each product file by the module it is installed as."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("mypy")

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("typecheck", ROOT / "scripts" / "typecheck.py")
typecheck = importlib.util.module_from_spec(spec)
spec.loader.exec_module(typecheck)


def test_every_product_folder_is_read_under_its_installed_name():
    dirs = typecheck.package_dirs(ROOT / "setup.cfg")
    # the folders of the design card, each mapped as setup.cfg's package_dir says
    for folder in ("algos", "broker", "envs", "generators", "learner", "rollctl"):
        assert dirs[f"rollflash.{folder}"] == ROOT / folder
    names = {s.path: s.module for s in typecheck.sources(dirs)}
    assert names["learner/loop.py"] == "rollflash.learner.loop"
    assert names["broker/__init__.py"] == "rollflash.broker"
    assert names["rollflash/__init__.py"] == "rollflash"
    assert names["rollflash/errors.py"] == "rollflash.errors"
    # every .py file of every mapped folder, and nothing else (tests/ and scripts/ are not product)
    product = {str(p.relative_to(ROOT)) for d in dirs.values() for p in d.rglob("*.py")}
    assert set(names) == product
    assert not any(path.startswith(("tests/", "scripts/")) for path in names)
