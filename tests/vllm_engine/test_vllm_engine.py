"""The vLLM engine against the HF engine's definitions, for tied and untied embeddings.

Each test loads the weights it starts from, so the order of tests does not matter. Tolerance 1e-3
on log-probabilities: both engines run float32 on CPU; observed differences are ~1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch

# a submodule, not "vllm": pytest puts tests/ on sys.path, where this folder alone would import as
# an empty namespace package named vllm
pytest.importorskip("vllm")

from rollflash.generators.sampling import SamplingParams  # noqa: E402

T = 0.7
PROMPTS = ["1+2=", "33+4=", "7*8=", "12-5="]
TOL = 1e-3


def _flat(groups):
    return [s for g in groups for s in g]


def test_samples_follow_the_hf_engine_definitions(harness):
    from rollflash.generators.hf_engine import HFEngine

    h = harness
    h.engine.load_weights(h.model_dir / "model.safetensors", 0)
    groups = h.engine.generate(
        PROMPTS, SamplingParams(n=3, temperature=T, top_p=1.0, max_new_tokens=10)
    )
    hf = HFEngine(str(h.model_dir))
    hf_groups = hf.generate(
        PROMPTS, SamplingParams(n=2, temperature=T, top_p=1.0, max_new_tokens=10)
    )
    assert [len(g) for g in groups] == [3] * len(PROMPTS)
    eos = hf.eos_id
    for group, hf_group in zip(groups, hf_groups):
        for s in group:
            assert s.prompt_ids == hf_group[0].prompt_ids  # same tokenizer call: <bos> + chars
            assert s.prompt_ids[0] == hf.tokenizer.bos_token_id
            assert 1 <= len(s.response_ids) <= 10 and len(s.logprobs) == len(s.response_ids)
            assert eos not in s.response_ids[:-1]
            assert s.finished == (s.response_ids[-1] == eos)
            assert s.finished or len(s.response_ids) == 10
            assert s.text == hf.tokenizer.decode(s.response_ids, skip_special_tokens=True)
            assert s.token_versions == [0] * len(s.response_ids)
            assert all(lp <= 0.0 for lp in s.logprobs)
    # the reference is the HF engine's own definition (checked on its samples), and vLLM matches it
    assert h.max_error(_flat(hf_groups), 0, T) < 1e-4
    assert h.max_error(_flat(groups), 0, T) < TOL


def test_top_p_logprobs_are_taken_before_truncation(harness):
    h = harness
    h.engine.load_weights(h.model_dir / "model.safetensors", 0)
    top_p = 0.8
    samples = _flat(
        h.engine.generate(
            PROMPTS, SamplingParams(n=4, temperature=T, top_p=top_p, max_new_tokens=10)
        )
    )
    assert h.max_error(samples, 0, T) < TOL
    # the renormalised nucleus log-probability vLLM reports by default would fail that check:
    # log p_nucleus(x) = log p(x) - log(mass of the nucleus), and the mass is < 1 for some token
    shifts = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            probs = torch.softmax(h.hf(0)(ids).logits[0, len(s.prompt_ids) - 1 : -1] / T, dim=-1)
        for row in probs:  # [V] per response token
            sorted_p = row.sort(descending=True).values
            keep = int((sorted_p.cumsum(0) - sorted_p < top_p).sum())  # vLLM keeps the top one too
            shifts.append(-math.log(sorted_p[:keep].sum().item()))
    assert max(shifts) > 10 * TOL


def test_reload_makes_logprobs_match_the_new_weights(harness):
    h = harness
    h.engine.load_weights(h.model_dir / "model.safetensors", 0)
    version, path, _ = h.publish(seed=1)
    params = SamplingParams(n=3, temperature=T, top_p=1.0, max_new_tokens=10)

    before = _flat(h.engine.generate(PROMPTS, params))
    assert h.max_error(before, 0, T) < TOL
    assert h.max_error(before, version, T) > 50 * TOL  # published, not loaded yet

    h.engine.load_weights(path, version)
    after = _flat(h.engine.generate(PROMPTS, params))
    assert h.max_error(after, version, T) < TOL
    assert h.max_error(after, 0, T) > 50 * TOL
    assert all(s.token_versions == [version] * len(s.response_ids) for s in after)


def test_a_version_with_a_bad_checksum_is_never_loaded(harness, learner_broker, generator_broker):
    import time

    from rollflash.broker.weights.notify import VersionPublisher
    from rollflash.generators.fetch import SharedStoreSource
    from rollflash.generators.reload import WeightFollower

    h = harness
    publisher = VersionPublisher()
    source = SharedStoreSource(h.store, h.copies / "follower")
    follower = WeightFollower(generator_broker, source, h.engine, poll_interval_s=0.01, attempts=1)
    try:
        good, _, good_sha = h.publish(seed=2)
        path = str(h.store.version_dir(good))
        learner_broker.announce_weights(good, path, good_sha, publisher.endpoint)
        follower.wait_for(good, timeout_s=300)
        assert h.engine.version == good

        bad, _, bad_sha = h.publish(seed=3)
        bad_path = h.store.version_dir(bad) / "model.safetensors"
        data = bytearray(bad_path.read_bytes())
        data[-64] ^= 0x01  # one bit of one weight: the file still parses and would load
        bad_path.write_bytes(bytes(data))
        learner_broker.announce_weights(bad, str(bad_path.parent), bad_sha, publisher.endpoint)
        deadline = time.monotonic() + 300
        while follower.reload_refused == 0 and time.monotonic() < deadline:
            follower.maybe_reload(wait_s=0.05)
        assert follower.reload_refused == 1
        assert follower.loaded_version == good and h.engine.version == good

        samples = _flat(
            h.engine.generate(
                PROMPTS, SamplingParams(n=3, temperature=T, top_p=1.0, max_new_tokens=10)
            )
        )
        assert h.max_error(samples, good, T) < TOL
        assert h.max_error(samples, bad, T) > 50 * TOL
    finally:
        follower.close()
        publisher.close()


def test_interrupt_swaps_weights_between_tokens(harness):
    """on_step loads v_b after the 3rd decode step: each request's first 3 tokens come from v_a,
    the rest from v_b over a KV cache recomputed with v_b, so every token matches its version."""
    h = harness
    # heavily perturbed versions: many samples run past the swap at the 3rd token
    a, path_a, _ = h.publish(seed=4, scale=1.0)
    b, path_b, _ = h.publish(seed=5, scale=1.0)
    h.engine.load_weights(path_a, a)
    steps = []

    def on_step() -> None:
        steps.append(1)
        if len(steps) == 3:
            h.engine.load_weights(path_b, b)

    samples = _flat(
        h.engine.generate(
            PROMPTS,
            SamplingParams(n=8, temperature=T, top_p=1.0, max_new_tokens=12),
            on_step=on_step,
        )
    )
    # enough samples must span the swap; EOS within 3 tokens took 8 of 12 samples in one run
    # (tied model), so 32 samples with at least 4 spanning it
    assert sum(len(s.response_ids) > 3 for s in samples) >= 4
    for s in samples:
        k = min(3, len(s.response_ids))
        assert s.token_versions == [a] * k + [b] * (len(s.response_ids) - k)
        got = torch.tensor(s.logprobs)
        torch.testing.assert_close(got[:k], h.reference_logprobs(s, a, T)[:k], atol=TOL, rtol=0)
        torch.testing.assert_close(got[k:], h.reference_logprobs(s, b, T)[k:], atol=TOL, rtol=0)
    # without the swap the later tokens would not match v_b: the versions really differ
    long = [s for s in samples if len(s.response_ids) > 3]
    assert (
        max(
            (h.reference_logprobs(s, a, T)[3:] - torch.tensor(s.logprobs[3:])).abs().max().item()
            for s in long
        )
        > 50 * TOL
    )


def test_a_file_that_does_not_fit_the_model_is_refused(harness, tmp_path):
    """A partial file would otherwise load silently: vLLM's layer-wise reload keeps the old
    tensors of any layer the file does not mention."""
    from safetensors.torch import load_file, save_file

    h = harness
    h.engine.load_weights(h.model_dir / "model.safetensors", 0)
    version, path, _ = h.publish(seed=6)
    state = load_file(str(path))
    dropped = "model.layers.0.mlp.down_proj.weight"
    del state[dropped]
    save_file(state, str(tmp_path / "partial.safetensors"))
    with pytest.raises(ValueError, match=dropped):
        h.engine.load_weights(tmp_path / "partial.safetensors", version)
    assert h.engine.version == 0
    samples = _flat(
        h.engine.generate(PROMPTS, SamplingParams(n=2, temperature=T, top_p=1.0, max_new_tokens=10))
    )
    assert h.max_error(samples, 0, T) < TOL


def test_continuous_requests_join_mid_flight_abort_and_track_versions(harness):
    """Continuous batching (generators/continuous.py): a request added after others started
    decoding, a weight swap between steps, and an abort. Every returned sample matches the
    reference under the version recorded for each of its tokens; aborted requests never return."""
    h = harness
    a, path_a, _ = h.publish(seed=6, scale=1.0)
    b, path_b, _ = h.publish(seed=7, scale=1.0)
    h.engine.load_weights(path_a, a)
    params = SamplingParams(n=3, temperature=T, top_p=1.0, max_new_tokens=12)
    h.engine.add_request("first", PROMPTS[0], params)
    h.engine.add_request("dropped", PROMPTS[1], params)
    done: dict[str, list] = {"first": [], "dropped": [], "late": []}
    for _ in range(2):  # a sample may end (EOS) in these steps, of either request
        for key, sample in h.engine.step():
            done[key].append(sample)
    h.engine.abort("dropped")
    aborted = len(done["dropped"])
    h.engine.load_weights(path_b, b)
    h.engine.add_request("late", PROMPTS[2], params)  # joins the running batch under v_b
    assert h.engine.num_active == 3 - len(done["first"]) + 3
    while h.engine.num_active:
        for key, sample in h.engine.step():
            done[key].append(sample)
    assert len(done["dropped"]) == aborted  # nothing of an aborted request comes back
    assert len(done["first"]) == len(done["late"]) == 3
    for s in done["late"]:
        assert s.token_versions == [b] * len(s.response_ids)
        assert h.max_error([s], b, T) < TOL
    for s in done["first"]:
        k = s.token_versions.count(a)
        assert s.token_versions == [a] * k + [b] * (len(s.response_ids) - k)
        got = torch.tensor(s.logprobs)
        torch.testing.assert_close(got[:k], h.reference_logprobs(s, a, T)[:k], atol=TOL, rtol=0)
        torch.testing.assert_close(got[k:], h.reference_logprobs(s, b, T)[k:], atol=TOL, rtol=0)


def test_every_rollout_vllm_key_is_an_argument_of_this_vllm():
    """tests/unit/test_vllm_options.py checks what the engine passes to vllm.LLM; here, that this
    vLLM's EngineArgs (what LLM(**kwargs) builds) has a field of each name."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    from rollflash.broker.config.config import VLLMConfig
    from rollflash.generators.vllm_setup import llm_kwargs

    every = VLLMConfig(max_num_seqs=8, max_num_batched_tokens=512, kv_cache_memory_gb=1.0)
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    for on_cpu in (True, False):
        kwargs = llm_kwargs(every, "float32", 0, on_cpu)
        assert len(kwargs) == 16  # 10 keys (kv_cache_memory_gb as bytes) + 6 the engine sets
        assert set(kwargs) <= names, set(kwargs) - names


def test_generate_ids_continues_from_the_exact_tokens(harness):
    """Multi-turn episodes hand in token ids (generate_ids): the prompt is taken as given, not
    re-tokenized, and log-probabilities are those of that exact context."""
    h = harness
    h.engine.load_weights(h.model_dir / "model.safetensors", 0)
    tok = h.engine.tokenizer
    # a context no tokenizer call would produce from text: two prompts glued, no second BOS
    contexts = [tok("1+2=")["input_ids"] + tok("3", add_special_tokens=False)["input_ids"]]
    contexts.append(tok("33+4=")["input_ids"])
    groups = h.engine.generate_ids(
        contexts, SamplingParams(n=2, temperature=T, top_p=1.0, max_new_tokens=6)
    )
    assert [[s.prompt_ids for s in g] for g in groups] == [[c, c] for c in contexts]
    assert h.max_error(_flat(groups), 0, T) < TOL


def test_deltas_rebuild_the_file_the_engine_loads(harness, tmp_path):
    """Versions published as deltas (2% of every tensor changed each time): the follower rebuilds
    each version's full file from the one it holds, and vLLM's in-place reload of that file
    samples with exactly that version's weights."""
    from transformers import AutoModelForCausalLM

    from rollflash.broker.weights.delta_write import VersionChain
    from rollflash.broker.weights.weights import WeightStore
    from rollflash.generators.fetch import SharedStoreSource
    from rollflash.generators.held import HeldCopy
    from rollflash.generators.reload import WeightFollower

    h = harness
    store, chain = WeightStore(tmp_path / "run"), VersionChain(tmp_path / "chain", 100)
    announced: dict[str, str] = {}

    class Hash:
        def weights(self) -> dict[str, str]:
            return announced

    source = SharedStoreSource(store, tmp_path / "copies", HeldCopy(tmp_path / "held"))
    follower = WeightFollower(Hash(), source, h.engine, poll_interval_s=0.01, attempts=1)
    model = AutoModelForCausalLM.from_pretrained(h.model_dir)
    gen = torch.Generator().manual_seed(7)
    try:
        for version in range(101, 105):  # apart from the versions the other tests publish
            with torch.no_grad():
                for p in model.parameters():
                    hit = torch.rand(p.shape, generator=gen) < 0.02
                    p.add_(hit * p.std() * torch.randn(p.shape, generator=gen))
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            h.states[version] = state
            info = store.publish(state, version, version, chain=chain)
            announced.update(version=str(version), sha256=info.sha256)
            follower.wait_for(version, timeout_s=300)
            kind = store.manifest(version).kind
            assert kind == ("full" if version == 101 else "delta")
            samples = _flat(
                h.engine.generate(
                    PROMPTS, SamplingParams(n=2, temperature=T, top_p=1.0, max_new_tokens=10)
                )
            )
            assert h.max_error(samples, version, T) < TOL
        assert h.max_error(samples, 101, T) > 10 * TOL  # the deltas moved the weights
    finally:
        follower.close()
