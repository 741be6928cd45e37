"""How a vLLM engine is started: the environment vLLM reads at start, and the arguments of
`vllm.LLM` built from the `rollout.vllm` section (broker/config/config_gpu.py).

Nothing here imports vllm at module level: `llm_kwargs` is a pure function, so what reaches
`vllm.LLM` can be checked without vLLM installed (tests/unit/test_vllm_options.py).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from rollflash.broker.config.config_gpu import VLLMConfig
from rollflash.broker.config.config_model import resolve_model_dtype

log = logging.getLogger(__name__)

# the worker extension the engine's weight reloads call into (generators/vllm_engine.py)
_EXTENSION = "rollflash.generators.vllm_worker.WeightReloadExtension"

# Read by vLLM's CPU backend only; defaults that a user's environment overrides.
CPU_DEFAULTS = {
    # OpenMP threads left unpinned: pinned threads wait for cores that other processes hold
    # (several generators and a learner share one machine), unpinned ones run wherever is free
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # KV cache in GiB: ample for short RL responses, and leaves host memory to the other processes
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


def set_vllm_environment(kv_cache_from_config: bool = False) -> None:
    """Set the environment variables vLLM reads when an engine starts; call before `import vllm`.

    - VLLM_ENABLE_V1_MULTIPROCESSING=0 (always): the engine core runs in this process, so a
      `step()` is one forward pass and weight reloads land between tokens (interrupt mode);
    - VLLM_WORKER_MULTIPROC_METHOD=spawn unless set: a worker forked from a process that has run
      torch ops inherits its OpenMP pool state and decodes several times slower on CPU; a spawned
      worker starts clean;
    - `CPU_DEFAULTS` unless set; not the KV-cache size when `rollout.vllm.kv_cache_memory_gb`
      gives one (vLLM's CPU backend lets the variable override it).
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    for name, value in CPU_DEFAULTS.items():
        if name == "VLLM_CPU_KVCACHE_SPACE" and kv_cache_from_config:
            if os.environ.get(name):
                log.warning(
                    "%s=%s overrides rollout.vllm.kv_cache_memory_gb on CPU", name, os.environ[name]
                )
            continue
        os.environ.setdefault(name, value)


def llm_kwargs(opts: VLLMConfig, model_dtype: str, seed: int, on_cpu: bool) -> dict[str, Any]:
    """The arguments of `vllm.LLM` (other than the model) for `rollout.vllm` = `opts`: each key
    under vLLM's own name, nulls resolved for the device (config_gpu.py says how), then the
    settings this engine relies on."""
    dtype: str
    if opts.dtype != "auto":
        dtype = opts.dtype
    else:
        dtype = resolve_model_dtype(model_dtype, on_cuda=False) if on_cpu else "bfloat16"
    kwargs: dict[str, Any] = {
        "dtype": dtype,
        "seed": seed if opts.seed is None else opts.seed,
        "tensor_parallel_size": opts.tensor_parallel_size,
        "max_model_len": opts.max_model_len,
        "enforce_eager": on_cpu if opts.enforce_eager is None else opts.enforce_eager,
        "enable_prefix_caching": opts.enable_prefix_caching,
        # on CPU a share of host RAM: vLLM's default 0.9 would claim it for the KV cache
        "gpu_memory_utilization": opts.gpu_memory_utilization or (0.1 if on_cpu else 0.9),
    }
    if opts.max_num_seqs is not None:
        kwargs["max_num_seqs"] = opts.max_num_seqs
    if opts.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = opts.max_num_batched_tokens
    if opts.kv_cache_memory_gb is not None:
        kwargs["kv_cache_memory_bytes"] = int(opts.kv_cache_memory_gb * 2**30)
    return kwargs | {
        "generation_config": "vllm",
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": _EXTENSION,
        "disable_log_stats": True,
        "async_scheduling": False,
        # vLLM's CPU backend needs its multiprocessing executor to set up OpenMP threads
        "distributed_executor_backend": "mp" if on_cpu else None,
    }


def llm_class() -> type:
    """`vllm.LLM` (a function so that tests can capture what the engine passes it)."""
    from vllm import LLM

    return LLM


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU backend here."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())
