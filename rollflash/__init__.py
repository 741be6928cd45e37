"""rollflash: asynchronous RL post-training for LLMs.

The role folders stay at the repository's top level, because the layout is the architecture
(docs/ARCHITECTURE.md), but they are installed under this one namespace so that their generic
names cannot collide with other packages: setup.cfg's `package_dir` maps `rollflash.broker` to
`broker/`, `rollflash.learner` to `learner/`, and so on. Import them as `rollflash.broker`.
"""

__version__ = "0.1.0"
