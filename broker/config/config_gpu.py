"""Config sections for running on GPUs: `rollout.vllm:` (settings passed to `vllm.LLM`) and
`placement:` (which GPUs `rollctl run` gives each process, broker/config/placement.py).

These keys say how a process runs, not what the run trains, so they are left out of the config
fingerprint (broker/config/config.py): a generator on another host may use other memory shares or another
tensor-parallel size and still join the run.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, field_validator

from rollflash.broker.config.config_base import Number, Section
from rollflash.broker.config.config_errors import ConfigError


class VLLMConfig(Section):
    """`rollout.vllm:`: engine arguments of `vllm.LLM` (names as vLLM's own); null keeps the
    default each key describes."""

    gpu_memory_utilization: Number | None = Field(
        None,
        gt=0,
        le=1,
        description="share of the GPU's memory vLLM may take (on CPU: of host memory); "
        "null: 0.9 on a GPU, 0.1 on CPU",
    )
    tensor_parallel_size: StrictInt = Field(
        1, ge=1, description="GPUs one generator shards the model over (its CUDA_VISIBLE_DEVICES)"
    )
    max_model_len: StrictInt | None = Field(
        None, gt=0, description="longest prompt + response in tokens (null: the model's)"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights and activations; auto: bfloat16 on a GPU, model.dtype on CPU"
    )
    enforce_eager: StrictBool | None = Field(
        None, description="no CUDA graphs (null: eager on CPU, graphs on a GPU)"
    )
    enable_prefix_caching: StrictBool = Field(
        True, description="share the KV blocks of a common prefix (a group's prompt)"
    )
    max_num_seqs: StrictInt | None = Field(
        None, gt=0, description="sequences in one scheduled batch (null: vLLM's default)"
    )
    max_num_batched_tokens: StrictInt | None = Field(
        None, gt=0, description="tokens in one scheduled batch (null: vLLM's default)"
    )
    seed: StrictInt | None = Field(
        None,
        description="sampling seed (null: run.seed plus an offset per generator id; a fixed "
        "value makes every generator draw the same samples)",
    )
    kv_cache_memory_gb: Number | None = Field(
        None,
        gt=0,
        description="KV cache size in GiB instead of what gpu_memory_utilization leaves "
        "(null: on CPU 1, or $VLLM_CPU_KVCACHE_SPACE, which wins when set)",
    )


class PlacementConfig(Section):
    """`placement:`: the GPUs of one machine and who gets which (`rollctl run`)."""

    gpus: StrictStr | StrictInt | None = Field(
        None,
        description="GPU ids `rollctl run` hands out, '0-7' or '0,2,3' (null: every child "
        "inherits CUDA_VISIBLE_DEVICES)",
    )
    learner_gpus: StrictInt | None = Field(
        None,
        ge=0,
        description="the first N listed GPUs go to the learner, one per rank (null: "
        "trainer.num_trainer_workers; 0: the learner gets none)",
    )
    colocate: StrictBool = Field(
        False,
        description="generators share the learner's GPUs instead of taking the GPUs after them",
    )
    learner_memory_share: Number = Field(
        0.5,
        gt=0,
        lt=1,
        description="colocate: the share of each GPU's memory the fit check leaves to the learner",
    )


class TrainerGpuKeys(Section):
    """The learner's device, precision, memory and collective keys, part of `trainer:`
    (docs/gpu.md says what each costs).

    They say how the learner computes, not what the run trains, so like the keys above they are
    left out of the fingerprint: generators never read them."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="where the learner trains: auto takes cuda (cuda:LOCAL_RANK) when torch "
        "sees a GPU",
    )
    gradient_checkpointing: StrictBool | Literal["auto"] = Field(
        "auto",
        description="recompute each transformer block in the backward pass (non-reentrant): "
        "activation memory of one block instead of all, about 30% more compute; auto: on "
        "when the estimated activations of a micro-batch do not fit the GPU beside the "
        "weights and optimiser state (off on CPU)",
    )
    tf32: StrictBool = Field(
        True, description="on a GPU: TF32 tensor cores for the remaining float32 matmuls"
    )
    cuda_alloc_conf: StrictStr = Field(
        "expandable_segments:True",
        description="PYTORCH_CUDA_ALLOC_CONF of the learner's ranks, unless the environment "
        "sets it (expandable segments: less fragmentation); empty: torch's default",
    )
    dist_timeout_s: Number = Field(
        600.0,
        gt=0,
        description="with several ranks: a collective or barrier that waits this long ends "
        "the rank with an error naming the operation, instead of hanging",
    )
    fsdp_reduce_scatter: Literal["every_micro_batch", "last_micro_batch"] = Field(
        "every_micro_batch",
        description="strategy fsdp: reduce-scatter gradients after every micro-batch (sharded "
        "gradients only) or once per update (fewer collectives, but a full float32 gradient "
        "on every rank)",
    )
    compile: StrictBool = Field(
        False, description="torch.compile every transformer block (first steps are slow)"
    )
    logprob_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="dtype of the log-softmax over the vocabulary; log-probs are always "
        "returned in float32 for the ratio (bfloat16 costs about 1e-2 in log-prob)",
    )
    logprob_chunk: StrictInt = Field(
        1024,
        ge=0,
        description="positions whose log-softmax is computed at once (and recomputed in the "
        "backward pass) when a micro-batch's upcast logits exceed 64 MiB; 0: all at once",
    )
    publish_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="dtype of published weights (auto: model.dtype)"
    )
    background_publish: Literal["process", False] = Field(
        "process",
        description="where a version is written: process in a helper process while the next "
        "step collects and trains (the weights go from the device straight into its shared "
        "memory), false in the step; it is announced only once its manifest is durable",
    )

    @field_validator("background_publish", mode="before")
    @classmethod
    def _publish_mode(cls, mode: object) -> object:
        if mode is True:  # a thread's Python work would hold the GIL the training step needs
            raise ConfigError(
                "trainer.background_publish: true is not a mode; set process (a helper process "
                "writes the version while the next step runs) or false (the step writes it)"
            )
        if not isinstance(mode, bool | str):  # 0 would pass as false
            raise ConfigError(f"trainer.background_publish: must be process or false, got {mode!r}")
        return mode
