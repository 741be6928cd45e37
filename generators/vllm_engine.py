"""vLLM engine: the fast generator engine, hot-reloading weights from the weight store.

Behaviour log-probabilities are the engine contract's log_softmax(logits / temperature) before top-p
truncation (see `generators/sampling.py`). vLLM returns, by default, raw log_softmax(logits) without
temperature; we start it with `logprobs_mode="processed_logprobs"`, which is log_softmax(logits / T)
after top-k / top-p masking and renormalisation. With top_p = 1 that is exactly our quantity. For
top_p < 1 a worker hook (installed on first use) makes the sampler return the log-probabilities it
had just before truncation instead, so the learner's recomputation still matches (as in verl, the
log-probability is not renormalised over the nucleus).

Prompts are tokenized here with the model's own Hugging Face tokenizer by `encode_prompts`, exactly
as the HF engine and evaluation do (envs/chat.py), and handed to vLLM as token ids; responses are
decoded here too. vLLM runs with `generation_config="vllm"` so that the model's generation defaults
(extra EOS ids, top-k, repetition penalty) never change sampling behind our back.

Weight reload (`load_weights`): the verified safetensors file goes through vLLM's own in-place
reload (`Worker.reload_weights`, which calls the model's `load_weights` layer by layer), then the
prefix cache is reset, so no cached KV block computed with old weights is reused. Tied embeddings
need one more step: the file has no `lm_head.weight` (saved deduplicated), so the reload refills
`embed_tokens` - whose storage `lm_head` shares - but never re-processes `lm_head`; on CPU its
GEMM handle (a oneDNN / packed copy of the weight made at load time) then keeps computing logits
with the old embeddings. The worker extension re-processes every embedding-method layer that shares
its weight with another after each reload.

Multi-turn episodes (`generate_ids`, generators/episodes.py) hand in token ids: each turn continues
from the episode's exact context, and prefix caching recomputes only the tokens added since the
last turn. The episode runner reloads weights between its engine batches (`rollout.interrupt`), and
`generate_ids` takes `on_step` as `generate` does.

Continuous batching (`add_request` / `step` / `abort`, generators/continuous.py): each sample is
its own request (prefix caching shares the prompt), so it is returned the moment it finishes and
the redundant rest of a group can be aborted; weights reloaded between steps behave as below.

Interrupt mode (`on_step`): the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
the model still runs in a worker process), so one `step()` is one scheduled forward pass and nothing
runs between our calls. `on_step` is called after every step; if it loads new weights, running
requests are preempted and recomputed (vLLM's own "keep + clear cache" weight-update semantics):
tokens sampled before the swap keep the old version's log-probabilities, every later token is
sampled from the new weights over a KV cache recomputed with them, so each token's log-probability
is exactly that of the version recorded for it. Versions come from vLLM's per-request weight-version
spans (`CompletionOutput.weight_versions`), labelled by `set_weight_version` at each reload.

LoRA adapter versions (`load_adapter`, generators/vllm_lora.py): one vLLM adapter per version; a
request keeps the adapter it was added with to its end, so all its tokens carry that version,
while requests added after a load use the new one.

Process environment and engine arguments: generators/vllm_setup.py (the `rollout.vllm` section
becomes the arguments of `vllm.LLM`; the variables vLLM reads at start are set before it imports).
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open
from transformers import AutoTokenizer

from rollflash.broker.config.config_gpu import VLLMConfig
from rollflash.broker.config.model_dir import model_directory
from rollflash.envs import encoder_for, response_text
from rollflash.envs.chat import encode_prompts
from rollflash.envs.episode import Encode
from rollflash.generators import vllm_setup
from rollflash.generators.sampling import GeneratedSample, Groups, OnStep, SamplingParams
from rollflash.generators.vllm_lora import AdapterVersions, adapter_kwargs
from rollflash.generators.vllm_probe import prompt_logprobs

if TYPE_CHECKING:
    from rollflash.broker.config.config import Config

log = logging.getLogger(__name__)


class VLLMEngine:
    """Engine-protocol wrapper around `vllm.LLM`, stepped by hand so weights can change mid-batch.

    `options` is the `rollout.vllm` section (defaults when None); `dtype` is `model.dtype`, used on
    CPU when `options.dtype` is auto.
    """

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        seed: int = 0,
        options: VLLMConfig | None = None,
        trust_remote_code: bool = False,
        lora: tuple[int, int] | None = None,
    ):
        model_dir = model_directory(str(model_path))
        opts = options if options is not None else VLLMConfig()
        vllm_setup.set_vllm_environment(kv_cache_from_config=opts.kv_cache_memory_gb is not None)
        on_cpu = vllm_setup.on_cpu()
        kwargs = vllm_setup.llm_kwargs(opts, dtype, seed, on_cpu)
        if lora is not None:  # (rank, slots): adapter versions (generators/vllm_lora.py)
            kwargs |= adapter_kwargs(*lora)
        self._adapters = AdapterVersions() if lora is not None else None
        self.llm = vllm_setup.llm_class()(
            model=str(model_dir), trust_remote_code=trust_remote_code, **kwargs
        )
        self.tokenizer = AutoTokenizer.from_pretrained(
            model_dir, trust_remote_code=trust_remote_code
        )
        self.eos_id = self.tokenizer.eos_token_id
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.version = 0  # the model at model.path is v0
        self.llm.llm_engine.set_weight_version("0")
        # a tied lm_head may or may not be stored (the weight store never stores it): not compared
        tied = getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False)
        self._ignored = {"lm_head.weight"} if tied else set()
        self._shapes = self._names_and_shapes(sorted(model_dir.glob("*.safetensors")))
        self._pre_truncation = False
        self._batches = itertools.count()
        self._streams: dict[str, tuple[list[int], set[str]]] = {}  # continuous: key -> requests
        self._request_ids = itertools.count()
        where = "cpu" if on_cpu else f"gpu, tensor parallel {opts.tensor_parallel_size}"
        log.info("vLLM engine ready: %s (%s, %s)", model_dir, kwargs["dtype"], where)

    @classmethod
    def from_config(cls, cfg: Config, seed: int) -> VLLMEngine:
        """`model.path` with the `rollout.vllm` settings; `seed` seeds vLLM's sampling unless
        `rollout.vllm.seed` is set."""
        lora = None
        if cfg.model.lora is not None and cfg.publish_kind == "adapter":
            lora = (cfg.model.lora.rank, cfg.trainer.max_overdue_staleness + 2)
        return cls(
            cfg.model.path,
            dtype=cfg.model.dtype,
            seed=seed,
            options=cfg.rollout.vllm,
            trust_remote_code=cfg.model.trust_remote_code,
            lora=lora,
        )

    def load_weights(self, model_file: Path, version: int) -> None:
        """Load a verified safetensors file in place; safe between steps of a running batch."""
        shapes = self._names_and_shapes([Path(model_file)])
        if shapes != self._shapes:
            missing = sorted(set(self._shapes) - set(shapes))
            unexpected = sorted(set(shapes) - set(self._shapes))
            wrong = sorted(
                n for n in set(shapes) & set(self._shapes) if shapes[n] != self._shapes[n]
            )
            raise ValueError(
                f"weights {model_file} do not fit the model: missing {missing}, "
                f"unexpected {unexpected}, wrong shape {wrong}"
            )
        engine = self.llm.llm_engine
        engine.collective_rpc("rl_load_file", args=(str(model_file),))
        # running requests are preempted and recomputed with the new weights (their KV is stale)
        engine.reset_prefix_cache(reset_running_requests=True)
        engine.set_weight_version(str(version))
        self.version = version
        if self._adapters is not None:
            self._adapters.base_reloaded()

    def load_adapter(self, adapter_dir: Path, version: int) -> None:
        """Load a verified PEFT adapter as `version`: requests added from now on use it, running
        ones keep the adapter they started with (generators/vllm_lora.py)."""
        if self._adapters is None:
            raise NotImplementedError(
                "this vLLM engine was started without LoRA (model.lora with trainer.publish "
                "adapter or auto enables it)"
            )
        self._adapters.load(self.llm.llm_engine, adapter_dir, version)
        self.version = version

    def probe(self, ids: list[int]) -> list[float]:
        """The log-probabilities of `ids` under the loaded weights (and the current adapter),
        teacher-forced at temperature 1 (broker/weights/probe.py); call it while the engine is idle."""
        request_id = f"probe-{next(self._request_ids)}"
        lora = self._start([request_id])
        try:
            return prompt_logprobs(self.llm, ids, request_id, lora)
        finally:
            self._finish(request_id)

    def busy(self) -> bool:
        """Whether requests are in flight (a probe waits for none)."""
        return bool(self.llm.llm_engine.has_unfinished_requests())

    @property
    def compute_dtype(self) -> str:
        return str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")

    def _names_and_shapes(self, files: list[Path]) -> dict[str, tuple[int, ...]]:
        """Tensor names and shapes from safetensors headers (no tensor data is read)."""
        shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    if name not in self._ignored:
                        shapes[name] = tuple(st.get_slice(name).get_shape())
        return shapes

    def generate(
        self, prompts: list[str], params: SamplingParams, on_step: OnStep | None = None
    ) -> Groups:
        """Sample `params.n` responses per prompt; `on_step` runs between decode steps and may
        call `load_weights` (interrupt mode)."""
        return self.generate_ids(encode_prompts(self.tokenizer, prompts), params, on_step)

    def generate_ids(
        self, prompt_ids: list[list[int]], params: SamplingParams, on_step: OnStep | None = None
    ) -> Groups:
        """As `generate`, from token ids: a multi-turn episode continues from its exact tokens
        (prefix caching reuses the KV of the context it shares with its previous turn)."""
        sampling = self._sampling(params, params.n)
        engine, batch = self.llm.llm_engine, next(self._batches)
        request_ids = [f"b{batch}-p{i}" for i in range(len(prompt_ids))]
        inputs = self.llm.renderer.render_cmpl([{"prompt_token_ids": ids} for ids in prompt_ids])
        finished: dict[str, Any] = {}  # request id -> vLLM's RequestOutput
        try:
            lora = self._start(request_ids)
            for request_id, engine_input in zip(request_ids, inputs):
                engine.add_request(request_id, engine_input, sampling, lora_request=lora)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                if on_step is not None and engine.has_unfinished_requests():
                    on_step()
        except BaseException:
            engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            versions = {r: self._finish(r) for r in request_ids}
        return [
            [
                self._sample(ids, c, versions[r])
                for c in sorted(finished[r].outputs, key=lambda c: c.index)
            ]
            for ids, r in zip(prompt_ids, request_ids)
        ]

    def observation_encoder(self) -> Encode:
        """How environment observations become tokens (envs/episode.py)."""
        return encoder_for(self.tokenizer)

    def _sampling(self, params: SamplingParams, n: int):
        """vLLM sampling parameters for `n` samples, reported once all have finished."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        if params.temperature <= 0:
            raise ValueError(
                "rollout.temperature must be > 0: behaviour log-probabilities are "
                "log_softmax(logits / temperature)"
            )
        if params.top_p < 1.0:
            self._use_pre_truncation_logprobs()
        return VSamplingParams(
            n=n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=0,
            max_tokens=params.max_new_tokens,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    # --- continuous batching (generators/continuous.py) -----------------------------------------
    def add_request(self, key: str, prompt: str, params: SamplingParams) -> None:
        """Start `params.n` samples of `prompt`, each its own vLLM request (`key#i`), so that
        `step` returns every sample as it finishes and `abort` can stop the rest."""
        ids = encode_prompts(self.tokenizer, [prompt])[0]
        engine_input = self.llm.renderer.render_cmpl([{"prompt_token_ids": ids}])[0]
        sampling = self._sampling(params, 1)
        # request ids are never reused: a group started again gets new ones
        requests = {f"{key}#{next(self._request_ids)}" for _ in range(params.n)}
        lora = self._start(requests)
        for request_id in sorted(requests):
            self.llm.llm_engine.add_request(request_id, engine_input, sampling, lora_request=lora)
        self._streams[key] = (ids, requests)

    @property
    def num_active(self) -> int:
        return sum(len(requests) for _, requests in self._streams.values())

    def step(self) -> list[tuple[str, GeneratedSample]]:
        """One scheduled forward pass; returns the samples that finished in it."""
        done = []
        for out in self.llm.llm_engine.step():
            if not out.finished:
                continue
            key = out.request_id.rsplit("#", 1)[0]
            prompt_ids, requests = self._streams[key]
            requests.discard(out.request_id)
            if not requests:
                del self._streams[key]
            version = self._finish(out.request_id)
            done.append((key, self._sample(prompt_ids, out.outputs[0], version)))
        return done

    def abort(self, key: str) -> None:
        """Stop the unfinished samples of `key`."""
        _, requests = self._streams.pop(key, (None, set()))
        if requests:
            self.llm.llm_engine.abort_request(sorted(requests))
            for request_id in requests:
                self._finish(request_id)

    def _start(self, request_ids) -> object:
        """The LoRARequest of the current adapter version (None without one) for new requests."""
        return self._adapters.start(request_ids) if self._adapters is not None else None

    def _finish(self, request_id: str) -> int | None:
        """The adapter version a finished request ran with (None: no adapters, see spans)."""
        return self._adapters.finish(request_id) if self._adapters is not None else None

    def _sample(
        self, prompt_ids: list[int], completion, adapter_version: int | None = None
    ) -> GeneratedSample:
        ids = list(completion.token_ids)
        logprobs = [float(lp[t].logprob) for t, lp in zip(ids, completion.logprobs)]
        versions = [self.version] * len(ids)
        for span in completion.weight_versions or []:
            versions[span.start : span.end] = [int(span.version)] * (span.end - span.start)
        if adapter_version is not None:  # a request keeps the adapter it started with
            versions = [adapter_version] * len(ids)
        return GeneratedSample(
            prompt_ids=list(prompt_ids),
            response_ids=ids,
            logprobs=logprobs,
            finished=bool(ids) and ids[-1] == self.eos_id,
            text=response_text(self.tokenizer, ids, self.eos_id),
            token_versions=versions,
        )

    def _use_pre_truncation_logprobs(self) -> None:
        if self._pre_truncation:
            return
        if not all(self.llm.collective_rpc("rl_use_pre_truncation_logprobs")):
            raise NotImplementedError(
                "rollout.top_p < 1 with the vllm engine: this vLLM's sampler has no "
                "topk_topp_sampler to report pre-truncation log-probabilities; use top_p: 1.0"
            )
        self._pre_truncation = True

    def close(self) -> None:
        """Stop the worker processes now rather than at interpreter exit."""
        self.llm.llm_engine.engine_core.shutdown()
        if self._adapters is not None:
            self._adapters.close()
