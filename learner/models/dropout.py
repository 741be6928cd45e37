"""Dropout off in the models the learner trains: the policy (its LoRA adapters included) and the
critic.

The proximal pass, every update and the reference compute log-probs of the same tokens, and the
PPO ratio pi / pi_prox means something only if two of them differ where the weights differ. With
dropout on, each forward pass draws its own mask: the first update's ratio is not 1, the ratios
move on noise, and `policy/clip_frac` is partly noise. verl and prime-rl train the policy with
dropout off; so does TRL's GRPO (`disable_dropout`). The probabilities are set to 0 once, when
a model is built, and the modules stay in train mode, because transformers' gradient
checkpointing acts only in train mode.
"""

from __future__ import annotations

import torch


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Set every dropout probability in `model` to 0, in place; returns `model`. Covers dropout
    modules (LoRA's `lora_dropout` among them) and the float `*dropout` attributes through which
    transformers' attention layers apply dropout as a function (`attention_dropout`)."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in vars(module).items():
            if name.endswith("dropout") and isinstance(value, float):
                setattr(module, name, 0.0)
    return model
