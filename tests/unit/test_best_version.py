"""`eval.keep_best` (learner/evaluation/best.py): the version with the best held-out accuracy is kept under
run_dir/best whatever weights/ retention deletes, a tie keeps the earlier one, a resumed learner
continues from the record, and `rollctl export --best` exports it."""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rollflash.broker.config.config import config_from_dict
from rollflash.broker.weights.weights import WeightStore
from rollflash.learner.evaluation.best import BestVersion
from rollflash.learner.process.dist import full_state_dict
from rollflash.learner.tools.export import export_version


def _publish(store: WeightStore, version: int, value: float) -> None:
    store.publish({"w": torch.full((3,), value)}, version, step=version)


def test_the_best_version_survives_retention_and_a_tie_keeps_the_earlier(tmp_path):
    store, best = WeightStore(tmp_path), BestVersion(tmp_path)
    for v, acc in [(0, 0.3), (1, 0.5), (2, 0.5), (3, 0.4)]:
        _publish(store, v, float(v))
        best.offer(store, v, v, acc)
    assert best.latest() == 1 and best.accuracy == 0.5  # 0.5 again at v2 does not replace v1
    store.retain(keep=1, in_use=set())  # weights/ keeps v3 only
    assert store.versions() == [3] and best.store.versions() == [1]
    kept = load_file(str(best.store.version_dir(1) / "model.safetensors"))
    assert torch.equal(kept["w"], torch.full((3,), 1.0))
    again = BestVersion(tmp_path)  # a resumed learner reads the record
    assert again.latest() == 1 and not again.offer(store, 3, 3, 0.45)
    assert again.offer(store, 3, 3, 0.6) and again.store.versions() == [3]


def test_export_best_writes_the_kept_version(tmp_path, tiny_model_dir):
    cfg = config_from_dict(
        {"model": {"path": str(tiny_model_dir)}, "run": {"run_dir": str(tmp_path)}}
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    store, best = WeightStore(tmp_path), BestVersion(tmp_path)
    weights = {k: v.clone() for k, v in full_state_dict(model).items()}
    store.publish(weights, 0, step=0)
    best.offer(store, 0, 0, 0.7)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # tied: the embedding moves too
    store.publish(full_state_dict(model), 1, step=1)  # a worse, later version
    best.offer(store, 1, 1, 0.2)
    out = export_version(cfg, None, tmp_path / "out", best=True)
    exported = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(
        exported.model.embed_tokens.weight, weights["model.embed_tokens.weight"], atol=0, rtol=0
    )
    latest = export_version(cfg, None, tmp_path / "latest")
    moved = AutoModelForCausalLM.from_pretrained(latest).model.embed_tokens.weight
    assert not torch.equal(moved, weights["model.embed_tokens.weight"])


def test_a_version_stored_as_a_delta_is_kept_whole(tmp_path):
    from rollflash.broker.weights.delta_write import VersionChain
    from rollflash.broker.weights.weight_chain import verified_tensors

    store, best = WeightStore(tmp_path), BestVersion(tmp_path)
    chain = VersionChain(tmp_path / "publishing", 10)
    w = torch.zeros(1000)
    store.publish({"w": w}, 0, step=0, chain=chain)
    w[7] = 1.0  # one element: v1 is a delta against v0
    store.publish({"w": w}, 1, step=1, chain=chain)
    assert store.manifest(1).kind == "delta"
    assert best.offer(store, 1, 1, 0.9)
    shutil.rmtree(store.version_dir(0))  # what the delta stood on, gone: best/ holds v1 whole
    assert best.store.manifest(1).kind == "full"
    assert torch.equal(verified_tensors(best.store, 1)["w"], w)
