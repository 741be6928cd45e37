"""LoRA in the learner (learner/models/lora.py) and adapter versions (broker/weights/weights.py, the
HF engine): only adapters train, the reference is the base with adapters off, merged and adapter
versions give the policy's own log-probabilities, checkpoints hold the adapters only, and a tampered
adapter version is never loaded."""

from __future__ import annotations

import copy
import json
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollflash.broker.config.config import config_from_dict
from rollflash.broker.weights.digest import file_digest
from rollflash.broker.weights.weights import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    MANIFEST,
    WeightStore,
    unique_tensors,
)
from rollflash.generators.fetch import SharedStoreSource
from rollflash.generators.reload import WeightFollower
from rollflash.learner.build import build_optim
from rollflash.learner.durability.checkpoint import CheckpointStore, LearnerState
from rollflash.learner.durability.checkpoint_io import Trainables
from rollflash.learner.models.lora import (
    merged_state_dict,
    published_weights,
    trainable_parameters,
    with_adapters,
)
from rollflash.learner.rank import Models
from rollflash.learner.step.batch import MicroBatch
from rollflash.learner.step.logprobs import LogprobSpec, token_logprobs
from rollflash.learner.step.prepare import build_algo_models
from rollflash.learner.step.reference import AdaptersOffReference, ReferencePolicy
from rollflash.learner.step.train import train_step

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def _cfg(model_dir, lora=LORA, **trainer):
    return config_from_dict(
        {
            "model": {"path": str(model_dir), "lora": lora},
            "algo": {"kl_coef": 0.1},
            "trainer": trainer,
        }
    )


def _policy(model_dir, seed=0, lora=LORA):
    """A LoRA policy whose B matrices are random (a fresh adapter, B = 0, is the base itself)."""
    cfg = _cfg(model_dir, lora)
    policy = with_adapters(AutoModelForCausalLM.from_pretrained(model_dir), cfg.model.lora)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return cfg, policy


def _batch(tok, texts=("12+7=19", "3+4=7", "40+2=42")) -> MicroBatch:
    enc = tok(list(texts), return_tensors="pt", padding="max_length", max_length=10)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    # right padding, as the learner pads (batch.py): the tokenizer pads on the left
    ids = torch.stack([torch.cat([r[m.bool()], r[~m.bool()]]) for r, m in zip(ids, mask)])
    mask = torch.sort(mask, dim=1, descending=True).values
    zeros = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    return MicroBatch(ids, mask, mask[:, 1:].bool(), behav_logp=zeros, advantages=zeros)


def test_only_the_adapters_train_and_have_optimiser_state(tiny_model_dir):
    cfg, policy = _policy(tiny_model_dir)
    base_before = {n: p.clone() for n, p in policy.named_parameters() if not p.requires_grad}
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    # 1 layer x (q, v, up) x (A, B) = 6 adapter matrices, nothing else
    assert len(trainable) == 6 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    models = Models(policy, policy, None, build_algo_models(cfg, policy=policy), train_step)
    optim = build_optim(cfg, models)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    mb = _batch(tok)
    logp, _ = token_logprobs(policy, mb.input_ids, mb.attention_mask, 1.0)
    (-logp[mb.mask].mean()).backward()
    optim.optimizer.step()
    assert len(optim.optimizer.state) == 6  # AdamW moments for the 6 adapter matrices only
    for n, p in policy.named_parameters():
        if not p.requires_grad:
            torch.testing.assert_close(p, base_before[n], atol=0, rtol=0, msg=n)


@pytest.mark.parametrize("packed", [False, True])
def test_reference_is_the_base_with_adapters_off(tiny_model_dir, packed):
    cfg, policy = _policy(tiny_model_dir)
    policy.train()
    reference = build_algo_models(cfg, policy=policy).reference
    assert isinstance(reference, AdaptersOffReference) and reference.model is policy  # no copy
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    mb = _batch(tok)
    spec = LogprobSpec(temperature=0.7, packed=packed)
    ref = reference.logprobs(mb, spec)
    base = ReferencePolicy.load(tiny_model_dir, "float32").logprobs(mb, spec)
    torch.testing.assert_close(ref[mb.mask], base[mb.mask], atol=1e-6, rtol=0)
    assert policy.training  # the policy's mode is restored
    with torch.no_grad():
        own, _ = token_logprobs(policy.eval(), mb.input_ids, mb.attention_mask, 0.7)
    assert (own - base)[mb.mask].abs().max() > 1e-2  # the adapters do change the policy


def test_merged_weights_are_peft_merge_and_leave_the_base_untouched(tiny_model_dir):
    _, policy = _policy(tiny_model_dir)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    merged = merged_state_dict(policy)
    expected = copy.deepcopy(policy).merge_and_unload().state_dict()
    assert set(merged) == set(expected)
    for k in expected:
        torch.testing.assert_close(merged[k], expected[k], atol=1e-6, rtol=0, msg=k)
    for k, v in policy.state_dict().items():
        torch.testing.assert_close(v, before[k], atol=0, rtol=0, msg=k)  # bitwise the same
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.load_state_dict(merged, strict=False)
    mb = _batch(AutoTokenizer.from_pretrained(tiny_model_dir))
    with torch.no_grad():
        a, _ = token_logprobs(model, mb.input_ids, mb.attention_mask, 1.0)
        b, _ = token_logprobs(policy.eval(), mb.input_ids, mb.attention_mask, 1.0)
    torch.testing.assert_close(a[mb.mask], b[mb.mask], atol=1e-5, rtol=0)


def test_checkpoint_holds_the_adapters_only_and_restores_them(tiny_model_dir, tmp_path):
    _, policy = _policy(tiny_model_dir, seed=1)
    optimizer = torch.optim.AdamW(trainable_parameters(policy))
    path = CheckpointStore(tmp_path).save(LearnerState(step=3), Trainables(policy, optimizer))
    stored = dcp.FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata
    prefix = "app.policy.model."
    model = sorted(k.removeprefix(prefix) for k in stored if k.startswith(prefix))
    assert model == sorted(n for n, p in policy.named_parameters() if p.requires_grad)
    _, fresh = _policy(tiny_model_dir, seed=2)
    fresh_optim = torch.optim.AdamW(trainable_parameters(fresh))
    assert CheckpointStore.load(path, Trainables(fresh, fresh_optim)).step == 3
    for k, v in fresh.state_dict().items():
        torch.testing.assert_close(v, policy.state_dict()[k], atol=0, rtol=0, msg=k)


class _Hash:
    def __init__(self) -> None:
        self.info: dict[str, str] = {}

    def weights(self) -> dict[str, str]:
        return self.info


def _follower(store: WeightStore, hash_: _Hash, engine) -> WeightFollower:
    source = SharedStoreSource(store, store.root.parent / "copies")
    return WeightFollower(hash_, source, engine, poll_interval_s=0.01, attempts=1)


def _publish(store: WeightStore, hash_: _Hash, policy, cfg, version: int) -> None:
    tensors, config = published_weights(policy, cfg)
    info = store.publish(tensors, version, version, adapter_config=config)
    hash_.info = {"version": str(version), "sha256": info.sha256}


@torch.no_grad()
def _max_error(engine, policy, tok, temperature: float) -> float:
    """Largest |engine log-prob - learner log-prob| over the tokens of a sampled batch."""
    from rollflash.generators.sampling import SamplingParams

    params = SamplingParams(n=3, temperature=temperature, top_p=1.0, max_new_tokens=6)
    worst = 0.0
    for group in engine.generate(["12+7=", "3+4="], params):
        for s in group:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logp, _ = token_logprobs(policy.eval(), ids, torch.ones_like(ids), temperature)
            ours = logp[0, len(s.prompt_ids) - 1 :]
            worst = max(worst, (ours - torch.tensor(s.logprobs)).abs().max().item())
    return worst


def test_hf_engine_log_probs_after_an_adapter_version_equal_the_learners(tiny_model_dir, tmp_path):
    from rollflash.generators.hf_engine import HFEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg, policy = _policy(tiny_model_dir)
    assert cfg.publish_kind == "adapter"
    engine, store, hash_ = HFEngine(str(tiny_model_dir)), WeightStore(tmp_path), _Hash()
    follower = _follower(store, hash_, engine)
    _publish(store, hash_, policy, cfg, 1)
    follower.wait_for(1, timeout_s=60)
    assert _max_error(engine, policy, tok, 0.8) < 1e-4
    _, policy2 = _policy(tiny_model_dir, seed=5)  # the next version: the same slot, new tensors
    _publish(store, hash_, policy2, cfg, 2)
    follower.wait_for(2, timeout_s=60)
    assert _max_error(engine, policy2, tok, 1.0) < 1e-4
    # full weights that do not fit are refused before the adapter is touched
    merged = merged_state_dict(policy)
    bad = unique_tensors({k: v for k, v in merged.items() if not k.endswith("up_proj.weight")})
    with pytest.raises(ValueError, match="up_proj"):
        engine.new_weights([(k, tuple(v.shape), v.dtype) for k, v in bad.items()])
    assert hasattr(engine.model, "peft_config")
    assert _max_error(engine, policy2, tok, 1.0) < 1e-4
    # a merged full version replaces the adapter: the model holds every weight again
    hash_.info = {"version": "3", "sha256": store.publish(merged, 3, 3).sha256}
    follower.wait_for(3, timeout_s=60)
    assert not hasattr(engine.model, "peft_config")
    assert _max_error(engine, policy, tok, 1.0) < 1e-4
    follower.close()


class _Recorder:
    """An engine that records the adapters it is given."""

    vocab_size = 51

    def __init__(self) -> None:
        self.adapters: list[tuple[int, dict]] = []

    def load_adapter(self, adapter_dir, version: int) -> None:
        self.adapters.append((version, json.loads((adapter_dir / ADAPTER_CONFIG).read_text())))


@pytest.mark.parametrize("tamper", ["tensors", "config", "config_and_manifest"])
def test_a_tampered_adapter_version_is_never_loaded(tiny_model_dir, tmp_path, tamper):
    cfg, policy = _policy(tiny_model_dir)
    store, hash_, engine = WeightStore(tmp_path), _Hash(), _Recorder()
    _publish(store, hash_, policy, cfg, 1)
    d = store.version_dir(1)
    if tamper == "tensors":
        raw = bytearray((d / ADAPTER_FILE).read_bytes())
        raw[-1] ^= 0xFF  # one flipped bit of an adapter weight
        (d / ADAPTER_FILE).write_bytes(bytes(raw))
    else:
        config = json.loads((d / ADAPTER_CONFIG).read_text())
        config["lora_alpha"] = 64.0  # 8x the update, same tensors
        (d / ADAPTER_CONFIG).write_text(json.dumps(config))
        if tamper == "config_and_manifest":  # the manifest rewritten to match: the announced
            manifest = json.loads((d / MANIFEST).read_text())  # digest still covers the config
            entry = file_digest((d / ADAPTER_CONFIG).read_bytes()).manifest_entry()
            manifest["files"][ADAPTER_CONFIG] = entry
            (d / MANIFEST).write_text(json.dumps(manifest))
    follower = _follower(store, hash_, engine)  # follows from here: v1 is tampered already
    deadline = time.monotonic() + 60
    while follower.reload_refused == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert follower.reload_refused == 1 and follower.loaded_version == 0 and engine.adapters == []
    _publish(store, hash_, policy, cfg, 2)  # an intact version after it loads as usual
    follower.wait_for(2, timeout_s=60)
    assert [v for v, _ in engine.adapters] == [2]
    assert engine.adapters[0][1]["lora_alpha"] == 8.0 and engine.adapters[0][1]["r"] == 4
    follower.close()


def test_adapter_versions_are_a_small_fraction_and_kept_like_full_ones(tiny_model_dir, tmp_path):
    cfg, policy = _policy(tiny_model_dir)
    store = WeightStore(tmp_path)
    for v in range(1, 5):
        tensors, config = published_weights(policy, cfg)
        store.publish(tensors, v, v, adapter_config=config)
    full = store.publish(merged_state_dict(policy), 5, 5)
    assert store.retain(keep=2, in_use={1}) == [2, 3]  # the same rule as for full versions
    assert store.versions() == [1, 4, 5]
    adapter = store.manifest(4)
    assert adapter.kind == "adapter" and set(adapter.files) == {ADAPTER_FILE, ADAPTER_CONFIG}
    assert adapter.size < store.manifest(5, expect_sha256=full.sha256).size / 4
