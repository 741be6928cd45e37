"""LoRA adapter versions in the vLLM engine (CPU build): after loading adapter version v through
the weight follower, the engine's log-probabilities equal the learner's recomputation at v within
1e-4, and a request keeps the adapter it started with when a newer version loads mid-batch (all
its tokens carry that version), in `generate` (interrupt mode) and in continuous batching. The
probe the follower reports after each load (broker/weights/probe.py) proves the adapter served, and gives
away an adapter update that vLLM never applied.

One engine with LoRA enabled (~30 s to start) on the tied tiny model; the learner's side is the
LoRA policy of learner/models/lora.py with seeded random B matrices, so versions differ clearly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("peft")

from rollflash.generators.sampling import SamplingParams  # noqa: E402

T = 0.8
PROMPTS = ["1+2=", "33+4=", "7*8="]
TOL = 1e-4
RUN = "lora-run"  # the run id the probe tokens are drawn from
LORA = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}


class _Hash:
    def __init__(self) -> None:
        self.info: dict[str, str] = {}

    def weights(self) -> dict[str, str]:
        return self.info


class _Learner:
    """LoRA policies of the learner and the store they are published to as adapter versions."""

    def __init__(self, model_dir, run_dir):
        from rollflash.broker.config.config import config_from_dict
        from rollflash.broker.weights.weights import WeightStore

        self.cfg = config_from_dict(
            {"model": {"path": str(model_dir), "lora": LORA}, "rollout": {"engine": "vllm"}}
        )
        self.model_dir, self.store, self.hash = model_dir, WeightStore(run_dir), _Hash()
        self.policies: dict[int, torch.nn.Module] = {}

    def publish(self, seed: int) -> int:
        from transformers import AutoModelForCausalLM

        from rollflash.learner.models.lora import published_weights, with_adapters

        base = AutoModelForCausalLM.from_pretrained(self.model_dir)
        policy = with_adapters(base, self.cfg.model.lora)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        version = max(self.policies, default=0) + 1
        tensors, config = published_weights(policy, self.cfg)
        info = self.store.publish(tensors, version, version, adapter_config=config)
        self.hash.info = {"version": str(version), "sha256": info.sha256}
        self.policies[version] = policy.eval()
        return version

    @torch.no_grad()
    def error(self, sample, version: int) -> float:
        """max |engine log-prob - learner log-prob at `version`| over the sample's tokens."""
        from rollflash.learner.step.logprobs import token_logprobs

        ids = torch.tensor([sample.prompt_ids + sample.response_ids])
        logp, _ = token_logprobs(self.policies[version], ids, torch.ones_like(ids), T)
        ours = logp[0, len(sample.prompt_ids) - 1 :]
        return (ours - torch.tensor(sample.logprobs)).abs().max().item()


@pytest.fixture(scope="module")
def lora_setup(model_dirs, tmp_path_factory):
    from rollflash.generators.fetch import SharedStoreSource
    from rollflash.generators.reload import WeightFollower
    from rollflash.generators.vllm_engine import VLLMEngine

    learner = _Learner(model_dirs["tied"], tmp_path_factory.mktemp("lora_run"))
    engine = VLLMEngine.from_config(learner.cfg, seed=0)  # LoRA on: publish_kind is adapter
    source = SharedStoreSource(learner.store, learner.store.root.parent / "copies")
    follower = WeightFollower(
        learner.hash, source, engine, poll_interval_s=0.01, attempts=1, run_id=RUN
    )
    try:
        yield learner, engine, follower
    finally:
        follower.close()
        engine.close()


def test_adapter_versions_match_the_learner_and_requests_keep_their_adapter(lora_setup):
    learner, engine, follower = lora_setup
    a = learner.publish(seed=1)
    follower.wait_for(a, timeout_s=300)
    assert engine.version == a
    b = learner.publish(seed=2)  # loaded by on_step after the 3rd decode step of the batch
    steps = []

    def on_step() -> None:
        steps.append(1)
        if len(steps) == 3:  # b is fetched in the background: wait here until it is staged
            assert follower.maybe_reload(wait_s=300)

    params = SamplingParams(n=4, temperature=T, top_p=1.0, max_new_tokens=10)
    first = [s for g in engine.generate(PROMPTS, params, on_step=on_step) for s in g]
    assert follower.loaded_version == b and sum(len(s.response_ids) > 3 for s in first) >= 2
    for s in first:  # started on a: every token from a, even after b loaded
        assert s.token_versions == [a] * len(s.response_ids)
        assert learner.error(s, a) < TOL
    after = [s for g in engine.generate(PROMPTS, params) for s in g]
    for s in after:
        assert s.token_versions == [b] * len(s.response_ids)
        assert learner.error(s, b) < TOL
    # the versions really differ: v_a's log-probs do not explain what v_b sampled
    assert max(learner.error(s, a) for s in after) > 100 * TOL


def test_continuous_requests_keep_the_adapter_they_started_with(lora_setup):
    learner, engine, follower = lora_setup
    c = learner.publish(seed=3)
    follower.wait_for(c, timeout_s=300)
    params = SamplingParams(n=2, temperature=T, top_p=1.0, max_new_tokens=10)
    engine.add_request("early", PROMPTS[0], params)
    done: dict[str, list] = {"early": [], "late": []}
    for key, sample in engine.step():
        done[key].append(sample)
    d = learner.publish(seed=4)
    follower.wait_for(d, timeout_s=300)
    engine.add_request("late", PROMPTS[1], params)  # joins the running batch under v_d
    while engine.num_active:
        for key, sample in engine.step():
            done[key].append(sample)
    assert len(done["early"]) == len(done["late"]) == 2
    for key, version in (("early", c), ("late", d)):
        for s in done[key]:
            assert s.token_versions == [version] * len(s.response_ids)
            assert learner.error(s, version) < TOL


def test_the_probe_proves_the_adapter_and_catches_one_not_applied(lora_setup, monkeypatch):
    from rollflash.broker.weights.probe import LearnerProbe, parse_report, verdict
    from rollflash.learner.durability.publish import learner_probe

    learner, engine, follower = lora_setup

    def learners(version: int) -> LearnerProbe:
        values = learner_probe(learner.policies[version], RUN, torch.device("cpu"))
        return LearnerProbe(tuple(values), "float32")

    e = learner.publish(seed=5)
    follower.wait_for(e, timeout_s=300)
    follower.maybe_reload()  # the probe waits for an idle engine
    served = parse_report(follower.probe_fields)
    assert served is not None and served.version == e and served.dtype == "float32"
    assert verdict(served, learners(e), None, None) is None  # float32: within 1e-3
    # an adapter update vLLM never applies: the engine goes on with the adapter it had, and
    # reports the new version
    monkeypatch.setattr(engine._adapters, "load", lambda *args: None)
    f = learner.publish(seed=6)
    follower.wait_for(f, timeout_s=300)
    follower.maybe_reload()
    stale = parse_report(follower.probe_fields)
    assert stale is not None and stale.version == f == engine.version
    assert stale.values == served.values  # computed with adapter e, bit for bit
    why = verdict(stale, learners(f), (served, learners(e)), None)
    assert why is not None and f"its probe of v{f}" in why
