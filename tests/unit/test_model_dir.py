"""`model.path` as a hub id: read from the local Hugging Face cache (a fake one in a temporary
HF_HOME, in the hub's standard layout), never downloaded; one line when it is missing."""

from __future__ import annotations

import shutil

import pytest

from rollflash.broker.config.model_dir import model_directory

REVISION = "0123456789abcdef0123456789abcdef01234567"


def fake_cache_entry(hf_home, repo_id: str, files_from) -> object:
    """hub/models--org--name/{refs/main, snapshots/<rev>/...} as huggingface_hub writes it."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    for f in files_from.iterdir():
        shutil.copy(f, snapshot / f.name)
    return snapshot


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_a_hub_id_resolves_to_its_cached_snapshot_and_loads(hf_home, tiny_model_dir):
    from rollflash.generators.hf_engine import HFEngine

    snapshot = fake_cache_entry(hf_home, "rollflash/tiny", tiny_model_dir)
    assert model_directory("rollflash/tiny") == snapshot
    engine = HFEngine("rollflash/tiny")  # what a generator does with model.path
    assert engine.vocab_size == engine.model.config.vocab_size > 0


def test_a_local_directory_is_used_as_it_is(hf_home, tiny_model_dir):
    assert model_directory(str(tiny_model_dir)) == tiny_model_dir


def test_a_missing_hub_model_says_what_to_download_in_one_line(hf_home):
    with pytest.raises(FileNotFoundError) as e:
        model_directory("Qwen/Qwen2.5-0.5B-Instruct")
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("model.path: no model directory at Qwen/Qwen2.5-0.5B-Instruct")
    assert "huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct" in message
    assert str(hf_home / "hub") in message


def test_a_path_that_is_no_hub_id_is_a_missing_directory(hf_home, tmp_path):
    (tmp_path / "empty").mkdir()
    for path in (str(tmp_path / "empty"), "./models/none/../x"):
        with pytest.raises(FileNotFoundError, match=r"^model.path: no Hugging Face model dir"):
            model_directory(path)


def test_trust_remote_code_reaches_every_from_pretrained(hf_home, tiny_model_dir, monkeypatch):
    import transformers

    from rollflash.broker.config.config import load_config
    from rollflash.learner.models.policy import load_policy

    seen = []
    for cls in (transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        original = cls.from_pretrained.__func__

        def spy(klass, path, *args, _original=original, **kwargs):
            seen.append(kwargs.get("trust_remote_code"))
            return _original(klass, path, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    assert load_config(None).model.trust_remote_code is False
    fake_cache_entry(hf_home, "rollflash/tiny", tiny_model_dir)
    load_policy(load_config(None, ["model.path=rollflash/tiny", "model.trust_remote_code=true"]))
    assert seen == [True, True]  # tokenizer, model


def test_check_model_files_names_a_missing_tokenizer_weights_or_shard(tmp_path, tiny_model_dir):
    """What a run checks before it starts (rollctl/preflight.py): one line naming the key and
    the directory for each part that is not there."""
    import json

    from rollflash.broker.config.model_dir import check_model_files
    from rollflash.errors import MissingFile

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    assert check_model_files(str(model)) == model
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).rename(tmp_path / name)
    with pytest.raises(MissingFile, match=rf"^model.path: no tokenizer in {model} \(none of "):
        check_model_files(str(model))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).rename(model / name)
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    with pytest.raises(MissingFile, match=rf"^model.path: no weights in {model} \(none of "):
        check_model_files(str(model))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}  # fmt: skip
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MissingFile) as e:
        check_model_files(str(model), key="rm.pretrain")
    assert str(e.value) == (
        f"rm.pretrain: model.safetensors.index.json in {model} names "
        "model-00002-of-00002.safetensors, which is not there (1 of 2 shards missing)"
    )
    with pytest.raises(MissingFile, match="^model.path: no Hugging Face model directory"):
        check_model_files(str(tmp_path / "nope"))
