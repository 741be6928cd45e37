"""rollflash: asynchronous RL post-training for LLMs.

The role folders stay at the repository's top level, because the layout is the architecture
(docs/ARCHITECTURE.md), but they are installed under this one namespace so that their generic
names cannot collide with other packages: setup.cfg's `package_dir` maps `rollflash.broker` to
`broker/`, `rollflash.learner` to `learner/`, and so on. Import them as `rollflash.broker`.

`from rollflash import Run` is the Python API (rollctl/api.py): `Run(config, dataset=rows,
callbacks=[...], **sections).train()`, or `start()` / `stop()` / `status()` / `export()`.
"""

__version__ = "0.1.0"

__all__ = ["Run", "RunFailed", "RunResult"]


def __getattr__(name: str):
    """`from rollflash import Run`: the Python API (rollctl/api.py), imported on first use so
    that `import rollflash` stays light."""
    if name in __all__:
        import importlib

        return getattr(importlib.import_module("rollflash.rollctl.api"), name)
    raise AttributeError(f"module 'rollflash' has no attribute {name!r}")
