"""Hugging Face transformers engine: the CPU / embedded engine, on a GPU with `rollout.device`.

Sampling uses `model.generate` on left-padded prompts (positions come from the attention mask, so
they equal the learner's right-padded positions). Behaviour log-probabilities are computed from the
raw logits as log_softmax(logits / temperature), the same quantity the learner recomputes; top-p
only restricts which tokens can be drawn (as in verl, the log-probability is not renormalised).
For that to be the distribution the tokens were drawn from, `generate` runs with a generation config
built from the run's sampling settings alone (`_generation_config`): transformers fills every
setting a config leaves unset from the checkpoint's generation_config.json (repetition_penalty,
no_repeat_ngram_size, min_p, top_k, extra EOS ids, ...), so the checkpoint's own config is replaced
at load by one that sets nothing but the EOS and pad ids, and what it would have applied is logged
once (as vLLM's `generation_config="vllm"`, generators/vllm_setup.py).
Sampling draws from torch's global generator, which `setup_process` seeds per generator. LoRA
adapter versions are loaded through peft on top of the base model (`load_adapter`). On a GPU
(`rollout.device`, generators/device.py) the model and the batch live on cuda:0 and only the
sampled ids and log-probabilities come back to the host.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from rollflash.broker.config.generation import neutral_generation_config
from rollflash.broker.config.model_dir import model_directory
from rollflash.envs import encoder_for, response_text
from rollflash.envs.chat import encode_prompts
from rollflash.envs.episode import Encode
from rollflash.generators.sampling import GeneratedSample, Groups, OnStep, SamplingParams

if TYPE_CHECKING:
    from rollflash.broker.config.config import Config

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ADAPTER_FILE = "adapter_model.safetensors"  # a PEFT adapter directory's tensors
# adapter_config.json keys that describe the file, not the adapter's shape
_PER_FILE_KEYS = {"base_model_name_or_path", "inference_mode", "revision", "peft_version"}


class HFEngine:
    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        device: str | torch.device = "cpu",
        trust_remote_code: bool = False,
    ):
        """`model_path`: a model directory or a cached hub id (broker/config/model_dir.py)."""
        model_dir = model_directory(str(model_path))
        self.tokenizer = AutoTokenizer.from_pretrained(
            model_dir, trust_remote_code=trust_remote_code
        )
        self.tokenizer.padding_side = "left"
        self.device = torch.device(device)
        # a transformers model, or the peft model wrapping it (load_adapter): their stubs type
        # `.to`, `generate` and the peft calls more narrowly than they behave
        model: Any = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=_DTYPES[dtype], trust_remote_code=trust_remote_code
        )
        self.model: Any = model.to(self.device).eval()
        self._adapter: dict | None = None  # the loaded LoRA adapter's config (load_adapter)
        self._shapes = {k: v.shape for k, v in self.model.state_dict().items()}
        self.vocab_size = self.model.config.vocab_size
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        )
        neutral_generation_config(
            model,
            self.eos_id,
            self.pad_id,
            f"hf engine: {model_dir}",
            "sampling uses rollout.temperature and rollout.top_p only, so the behaviour "
            "log-probs are the sampler's",
            log,
        )

    @classmethod
    def from_config(cls, cfg: Config, seed: int) -> HFEngine:
        """`model.path` in `model.dtype` (auto: by the device) on `rollout.device`; `seed` is
        unused: sampling draws from torch's global generator, which `setup_process` seeds."""
        from rollflash.broker.config.config_model import resolve_model_dtype
        from rollflash.generators.device import resolve_device

        device = resolve_device(cfg.rollout.device)
        dtype = resolve_model_dtype(cfg.model.dtype, device.type == "cuda")
        log.info("hf engine on %s (%s)", device, dtype)
        return cls(
            cfg.model.path,
            dtype=dtype,
            device=device,
            trust_remote_code=cfg.model.trust_remote_code,
        )

    def new_weights(
        self, layout: list[tuple[str, tuple[int, ...], torch.dtype]]
    ) -> dict[str, torch.Tensor]:
        """Empty tensors on the engine's device for a version; its names and shapes are checked
        against the model first, so a version that does not fit is refused before any of it is
        read or allocated, and the loaded weights stay whole."""
        shapes = {name: torch.Size(shape) for name, shape, _ in layout}
        current = self._shapes  # the base model's, also while an adapter wraps it
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        missing = sorted(set(current) - set(shapes) - tied)
        unexpected = sorted(set(shapes) - set(current))
        wrong = sorted(n for n in set(shapes) & set(current) if shapes[n] != current[n])
        if missing or unexpected or wrong:
            raise ValueError(
                f"the weights do not fit the model: missing {missing}, unexpected "
                f"{unexpected}, wrong shape {wrong}"
            )
        return {n: torch.empty(s, dtype=d, device=self.device) for n, s, d in layout}

    def swap_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Make the verified tensors the model's. They were allocated for it (`new_weights`: on
        its device), so a tensor of the model's dtype becomes the parameter's storage (no copy:
        the pause is a pointer per tensor, and the old weights are freed); one of another dtype
        is copied into it, as `load_state_dict` would. A LoRA adapter loaded before is removed:
        a full version holds every weight."""
        if self._adapter is not None:
            self.model, self._adapter = self.model.unload(), None
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets |= dict(self.model.named_buffers())
        with torch.no_grad():
            for name, t in weights.items():
                target = targets[name]
                if t.dtype == target.dtype and t.device == target.device:
                    target.data = t
                else:
                    target.copy_(t)
        self.model.tie_weights()

    def load_adapter(self, adapter_dir: Path, version: int) -> None:
        """Load a verified PEFT adapter (LoRA) on top of the base model through peft.

        The adapter is one peft adapter slot whose tensors are overwritten by each version: a
        batch runs to its end on the weights it started with, so one slot is enough, and peft
        never copies the base weights. The first version (or one with another adapter config)
        wraps the model; names and shapes are checked against the slot before any tensor is
        copied, and a wrap that does not fit is undone, so a refused version leaves the loaded
        weights whole."""
        from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
        from peft import set_peft_model_state_dict as set_adapter_state

        config = LoraConfig.from_pretrained(str(adapter_dir))
        state = load_file(str(adapter_dir / ADAPTER_FILE))
        shape = {k: v for k, v in config.to_dict().items() if k not in _PER_FILE_KEYS}
        fresh = self._adapter != shape
        if fresh:
            base = self.model.unload() if self._adapter is not None else self.model
            self._adapter, self.model = None, get_peft_model(base, config).eval()
        current = get_peft_model_state_dict(self.model)
        wrong = sorted(n for n in set(state) & set(current) if state[n].shape != current[n].shape)
        if set(state) != set(current) or wrong:
            if fresh:
                self.model = self.model.unload()
            raise ValueError(
                f"adapter {adapter_dir} does not fit the model: missing "
                f"{sorted(set(current) - set(state))}, unexpected "
                f"{sorted(set(state) - set(current))}, wrong shape {wrong}"
            )
        set_adapter_state(self.model, state)
        self._adapter = shape

    @torch.no_grad()
    def probe(self, ids: list[int]) -> list[float]:
        """The log-probabilities of `ids` under the loaded weights (and adapter), teacher-forced
        at temperature 1, in float32 (broker/weights/probe.py): the proof of what this engine serves."""
        x = torch.tensor([ids], device=self.device)
        logits = self.model(input_ids=x).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, x[0, 1:, None]).squeeze(-1)
        return logp.cpu().tolist()

    @property
    def compute_dtype(self) -> str:
        """The dtype the engine computes in ("float32", "bfloat16")."""
        return str(self.model.dtype).removeprefix("torch.")

    @torch.no_grad()
    def generate(
        self, prompts: list[str], params: SamplingParams, on_step: OnStep | None = None
    ) -> Groups:
        """Sample a batch; `on_step` is ignored: the batch always finishes on the loaded weights."""
        return self.generate_ids(encode_prompts(self.tokenizer, prompts), params)

    @torch.no_grad()
    def generate_ids(
        self, prompts: list[list[int]], params: SamplingParams, on_step: OnStep | None = None
    ) -> Groups:
        """As `generate`, from token ids (multi-turn episodes continue from their exact tokens)."""
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, ids in enumerate(prompts):  # left padding, as the tokenizer does for `generate`
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            attention[i, width - len(ids) :] = 1
        return self._sample_batch(input_ids, attention, params)

    def observation_encoder(self) -> Encode:
        """How environment observations become tokens (envs/episode.py)."""
        return encoder_for(self.tokenizer)

    def _sample_batch(
        self, input_ids: torch.Tensor, attention: torch.Tensor, params: SamplingParams
    ) -> Groups:
        """input_ids, attention: [P, W] int64, left-padded prompts -> P lists of params.n samples."""
        n_prompts = input_ids.shape[0]
        input_ids = input_ids.repeat_interleave(params.n, dim=0).to(self.device)
        attention = attention.repeat_interleave(params.n, dim=0).to(self.device)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            generation_config=self._generation_config(params),
        )
        width = input_ids.shape[1]
        new_tokens = out.sequences[:, width:]  # [N, S]
        logits = torch.stack(out.logits, dim=1).float()  # [N, S, V]
        logp = torch.log_softmax(logits / params.temperature, dim=-1)
        token_logp = logp.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1).cpu()  # [N, S]
        new_tokens, input_ids, attention = new_tokens.cpu(), input_ids.cpu(), attention.cpu()
        results: Groups = [[] for _ in range(n_prompts)]
        for row in range(new_tokens.shape[0]):
            prompt_ids = input_ids[row][attention[row].bool()].tolist()
            results[row // params.n].append(
                self._sample(prompt_ids, new_tokens[row], token_logp[row])
            )
        return results

    def _generation_config(self, params: SamplingParams) -> GenerationConfig:
        """Sampling at `params.temperature` and `params.top_p` and nothing else: every setting
        that shapes the distribution is given (top_k 0: off), and the model's own config, which
        fills what is left unset, sets only the EOS and pad ids (`__init__`)."""
        return GenerationConfig(
            do_sample=True,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=0,
            max_new_tokens=params.max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
        )

    def _sample(
        self, prompt_ids: list[int], tokens: torch.Tensor, logp: torch.Tensor
    ) -> GeneratedSample:
        ids = tokens.tolist()
        finished = self.eos_id in ids
        length = ids.index(self.eos_id) + 1 if finished else len(ids)
        return GeneratedSample(
            prompt_ids=prompt_ids,
            response_ids=ids[:length],
            logprobs=logp[:length].tolist(),
            finished=finished,
            text=response_text(self.tokenizer, ids[:length], self.eos_id),
        )
