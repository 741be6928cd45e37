"""The Kubernetes manifests (deploy/k8s), validated offline: nothing here reaches a cluster.

`kubectl kustomize` builds them (kubectl needs no server for that; `make test` installs it);
every object is checked against the Kubernetes API schemas of `kubernetes-validate` (strict:
an unknown field fails); and what the schemas cannot see: every Secret and ConfigMap a pod
names exists with the keys it names, the run config in the ConfigMap loads, the Redis pods'
configure script is valid sh, the learner's probes run `rollctl status --json`, generators and
the learner request GPUs, and they read the model and the data from the inputs volume, which
fetch-inputs.yaml (outside the kustomization: the one step that downloads) fills."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.30.0"


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (make test installs it: apt-get kubernetes-client)")
    out = subprocess.run(
        ["kubectl", "kustomize", str(ROOT / "deploy" / "k8s")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def _pod_specs(objects: list[dict]) -> dict[str, dict]:
    return {
        o["metadata"]["name"]: o["spec"]["template"]["spec"]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet", "Job")
    }


def test_every_object_matches_the_kubernetes_schema(objects):
    import kubernetes_validate

    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(
        ["ConfigMap"] * 2 + ["Secret", "Service", "Service"] + ["PersistentVolumeClaim"] * 2
        + ["Deployment", "StatefulSet", "Job", "Job"]
    )  # fmt: skip
    for o in objects:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)  # raises on a bad field


def test_a_bad_field_fails_validation(objects):
    import kubernetes_validate

    (gen,) = (o for o in objects if o["kind"] == "Deployment")
    bad = {**gen, "spec": {**gen["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_every_secret_and_configmap_a_pod_names_exists_with_its_keys(objects):
    data = {("ConfigMap", n): set(o["data"]) for n, o in _by_kind(objects, "ConfigMap").items()}
    for n, o in _by_kind(objects, "Secret").items():
        data[("Secret", n)] = set(o.get("stringData", o.get("data", {})))
    named = []
    for spec in _pod_specs(objects).values():
        for v in spec.get("volumes", []):
            if "secret" in v:
                items = v["secret"].get("items", [])
                named += [("Secret", v["secret"]["secretName"], i["key"]) for i in items]
            if "configMap" in v:
                named.append(("ConfigMap", v["configMap"]["name"], None))
        for c in spec.get("initContainers", []) + spec["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    named.append(("Secret", ref["name"], ref["key"]))
    assert named
    for kind, name, key in named:
        assert (kind, name) in data, f"{kind} {name} is not in the manifests"
        assert key is None or key in data[(kind, name)], f"{kind} {name} has no key {key}"


def test_the_run_config_loads(objects, tmp_path):
    from rollflash.broker.config.config import config_from_dict

    cfg_map = _by_kind(objects, "ConfigMap")["rollflash-run"]
    data = yaml.safe_load(cfg_map["data"]["run.yaml"])
    (tmp_path / "password").write_text("pw\n")
    data["redis"]["password_file"] = str(tmp_path / "password")  # the Secret's mount, here
    cfg = config_from_dict(data)
    assert len(cfg.redis.sentinel.hosts) == 3
    assert cfg.weights.transport == "http"  # no ReadWriteMany volume needed


def test_the_redis_configure_script_is_valid_sh(objects):
    script = _by_kind(objects, "ConfigMap")["redis-scripts"]["data"]["configure.sh"]
    subprocess.run(["sh", "-n"], input=script, text=True, check=True)


def test_probes_ask_rollctl_status_and_gpus_are_requested(objects):
    specs = _pod_specs(objects)
    for name in ("rollflash-learner", "rollflash-generator"):
        (c,) = specs[name]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    (learner,) = specs["rollflash-learner"]["containers"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert learner[probe]["exec"]["command"][:3] == ["rollctl", "status", "--json"]


def test_the_model_and_data_come_from_the_inputs_volume_and_nothing_downloads(objects):
    """No pod of the run downloads: the config names the model and the data by their paths on
    the inputs volume, which the learner and every generator mount read-only, and the image is
    offline (tests/unit/test_deploy_image.py). fetch-inputs.yaml writes those paths."""
    import kubernetes_validate

    cfg = yaml.safe_load(_by_kind(objects, "ConfigMap")["rollflash-run"]["data"]["run.yaml"])
    assert cfg["model"]["path"].startswith("/inputs/")
    assert cfg["task"]["name"] == "dataset" and cfg["task"]["params"]["path"].startswith("/inputs/")
    assert cfg["reward"]["functions"] == ["math"]
    assert "rollflash-inputs" in _by_kind(objects, "PersistentVolumeClaim")
    specs = _pod_specs(objects)
    for name in ("rollflash-learner", "rollflash-generator"):
        spec = specs[name]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "inputs"]
        assert volume["persistentVolumeClaim"] == {
            "claimName": "rollflash-inputs",
            "readOnly": True,
        }
        (c,) = spec["containers"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "inputs"]
        assert mount == {"name": "inputs", "mountPath": "/inputs", "readOnly": True}
        assert spec["securityContext"]["runAsNonRoot"] is True  # the image runs as uid 1000
        assert not any(e["name"].startswith("HF_") for e in c.get("env", []))  # stays offline
    fetch = yaml.safe_load((ROOT / "deploy" / "k8s" / "fetch-inputs.yaml").read_text())
    kubernetes_validate.validate(fetch, K8S_VERSION, strict=True)
    assert fetch["metadata"]["name"] not in _pod_specs(objects)  # not applied with the run
    script = " ".join(fetch["spec"]["template"]["spec"]["containers"][0]["args"])
    assert f"--local-dir {cfg['model']['path']}" in script
    assert f"save_to_disk('{cfg['task']['params']['path']}')" in script
