"""The learner process around its steps: this rank and its peers (`dist`), its device and
precision (`device`), the stop signals (`stop`), the fault hooks a test installs (`hooks`) and
the start of several ranks under torchrun (`launch`)."""
