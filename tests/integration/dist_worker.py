"""One learner rank for tests/integration/test_distributed_learner.py, run under torchrun (or
alone as the one-rank reference): two `train_step`s on this rank's share of fixed groups, then
rank 0 saves the weights (with `ddp-lora`: LoRA adapters on q_proj and v_proj, a KL term whose
reference is the base with the adapters off, and only the adapters saved; `ddp+lora` runs ddp
to OUT and then ddp-lora to OUT.lora in the same processes, saving a launch).

    python -m torch.distributed.run --standalone --nproc-per-node 2 dist_worker.py MODEL OUT GROUPS \
        ddp|fsdp|ddp-lora|ddp+lora
"""

import sys

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollflash.broker.config import config_from_dict
from rollflash.broker.schema import Sample, Trajectory
from rollflash.broker.weights import unique_tensors
from rollflash.learner.dist import init_dist, wrap_model
from rollflash.learner.lora import checkpoint_weights, trainable_parameters, with_adapters
from rollflash.learner.prepare import build_algo_models
from rollflash.learner.train import train_step


def make_groups(tok, count: int, n: int = 4) -> list[Trajectory]:
    """`count` groups of mixed response lengths and rewards, the same on every rank."""
    rng = np.random.default_rng(0)
    groups = []
    for g in range(count):
        prompt = tok(f"{g + 11}+{g + 3}=")["input_ids"]
        samples = []
        for _ in range(n):
            text = str(int(rng.integers(1, 10 ** int(rng.integers(1, 5)))))
            resp = tok(text)["input_ids"][1:] + [tok.eos_token_id]
            samples.append(
                Sample(
                    np.array(resp, "<i4"),
                    rng.uniform(-3, -0.5, len(resp)).astype("<f4"),
                    np.zeros(len(resp), "<i4"),
                    reward=float(rng.random()),
                    finished=True,
                )
            )
        groups.append(
            Trajectory(f"t{g}", f"p{g}", f"g{g}", "gen", 0, 0, np.array(prompt, "<i4"), samples)
        )
    return groups


def train(dist, model_dir: str, out: str, count: int, strategy: str) -> None:
    torch.manual_seed(0)  # every run (and rank) starts from the same adapters
    lora = {"rank": 4, "target_modules": ["q_proj", "v_proj"]} if strategy == "ddp-lora" else None
    cfg = config_from_dict(
        {
            "model": {"path": model_dir, "lora": lora},
            "rollout": {"num_return_sequences": 4, "max_new_tokens": 6},
            "trainer": {"micro_batch_size": 3},
            "algo": {"kl_coef": 0.1 if lora else 0.0},
        }
    )
    tok = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    if cfg.model.lora is not None:
        policy = with_adapters(policy, cfg.model.lora)
    model = wrap_model(policy, dist, strategy.removesuffix("-lora"))
    optimizer = torch.optim.AdamW(trainable_parameters(policy), lr=1e-3)
    groups = make_groups(tok, count)
    mine = groups[dist.rank :: dist.world_size]
    algo = build_algo_models(cfg, dist, policy)
    for _ in range(2):
        stats = train_step(model, optimizer, mine, cfg, algo, dist)
        assert stats["optim/skipped"] == 0.0
    weights = checkpoint_weights(model)  # the whole model, or only the adapters with LoRA
    if dist.is_main:
        save_file(unique_tensors(weights), out)


def main(model_dir: str, out: str, count: int, strategy: str) -> None:
    """`ddp+lora`: the ddp run to OUT, then the ddp-lora run to OUT.lora, in one launch."""
    torch.use_deterministic_algorithms(True)
    dist = init_dist()
    for i, name in enumerate(strategy.split("+")):
        train(dist, model_dir, out + ".lora" * i, count, "ddp-lora" if name == "lora" else name)
    dist.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
