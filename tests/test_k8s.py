"""The Kubernetes manifests (deploy/k8s/) render, with our own renderer and with
``kubectl kustomize`` where it is installed, to the same objects, and every object is
valid against the Kubernetes API schemas (kubernetes-validate). No cluster needed."""

from __future__ import annotations

import copy
import importlib.util
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from tests.cluster import ROOT

K8S = ROOT / "deploy" / "k8s"
_spec = importlib.util.spec_from_file_location("k8s_render", K8S / "render.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)

OVERLAYS = ["overlays/cpu", "overlays/gpu", "overlays/servicemonitor"]
# The oldest API the manifests promise to fit (lifecycle preStop sleep is 1.30).
KUBE_VERSION = "1.30"


def by_name(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_every_object_is_valid_against_the_api_schema(overlay):
    objects = render.build(K8S / overlay)
    kinds = sorted({o["kind"] for o in objects})
    assert {"ConfigMap", "Deployment", "StatefulSet", "Service",
            "PodDisruptionBudget"} <= set(kinds)
    for obj in objects:
        if obj["apiVersion"] == "monitoring.coreos.com/v1":  # a CRD: no schema shipped
            check_service_monitor(obj, objects)
            continue
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def check_service_monitor(sm: dict, objects: list[dict]) -> None:
    assert sm["kind"] == "ServiceMonitor"
    want = sm["spec"]["selector"]["matchLabels"]
    services = [o for o in objects if o["kind"] == "Service"
                and want.items() <= o["metadata"].get("labels", {}).items()]
    ports = {p["name"] for s in services for p in s["spec"]["ports"]}
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= ports
    # Every process is scraped: gateway (http), conductor, workers, cache pool (metrics).
    assert {s["metadata"]["name"] for s in services} == {
        "pdserve-gateway", "pdserve-conductor", "pdserve-workers", "pdserve-cache-pool"}
    for s in services:
        assert {"http", "metrics"} & {p["name"] for p in s["spec"]["ports"]}, s


def test_a_wrong_field_fails_the_schema():
    """The schema check bites: a typo'd field and a bad type are both refused."""
    deploy = by_name(render.build(K8S / "overlays/cpu"))[("Deployment", "pdserve-decode")]
    bad = copy.deepcopy(deploy)
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSION, strict=True)
    bad = copy.deepcopy(deploy)
    bad["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSION, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_kubectl_kustomize_renders_the_same_objects(overlay):
    out = subprocess.run(["kubectl", "kustomize", str(K8S / overlay)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    theirs = by_name([d for d in yaml.safe_load_all(out) if d])
    ours = by_name(render.build(K8S / overlay))
    assert sorted(ours) == sorted(theirs)
    for key, obj in ours.items():
        assert obj == theirs[key], key


def test_the_config_map_is_local_toml_rendered_for_the_cluster():
    assert (K8S / "base" / "pdserve.toml").read_text() == render.render_cluster_toml(), \
        "deploy/k8s/base/pdserve.toml is stale: run python deploy/k8s/render.py config"
    cms = [o for o in render.build(K8S / "base") if o["kind"] == "ConfigMap"]
    assert len(cms) == 1 and set(cms[0]["data"]) == {"pdserve.toml"}
    # kustomize's content hash: a changed config renames the map and rolls the pods.
    assert cms[0]["metadata"]["name"] == "pdserve-config-" + render.config_map_hash(cms[0])
    assert render.config_map_hash({"data": {"x.toml": "a = 1\n"}}) == "8f2kk4fk87"


def test_strategic_merge_keys_lists_by_name_and_replaces_others():
    base = {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}],
                            "args": ["p", "q"]}, {"name": "b"}]}
    patch = {"containers": [{"name": "a", "env": [{"name": "Y", "value": "2"},
                                                  {"name": "X", "value": "3"}],
                             "args": ["r"]}]}
    out = render.strategic_merge(base, patch)
    assert out == {"containers": [{"name": "a", "env": [{"name": "Y", "value": "2"},
                                                        {"name": "X", "value": "3"}],
                                   "args": ["r"]}, {"name": "b"}]}
    assert base["containers"][0]["env"] == [{"name": "X", "value": "1"}]  # not mutated
    with pytest.raises(render.RenderError, match="directive"):
        render.strategic_merge(base, {"$patch": "delete"})


def test_json6902_adds_replaces_and_removes():
    doc = {"spec": {"replicas": 1, "ports": [{"port": 1}]}}
    out = render.json6902(doc, [{"op": "replace", "path": "/spec/replicas", "value": 3},
                                {"op": "add", "path": "/spec/ports/-", "value": {"port": 2}},
                                {"op": "remove", "path": "/spec/ports/0"}])
    assert out == {"spec": {"replicas": 3, "ports": [{"port": 2}]}}
    with pytest.raises(render.RenderError, match="missing"):
        render.json6902(doc, [{"op": "replace", "path": "/spec/nope", "value": 1}])


def test_the_renderer_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(render.RenderError, match="namePrefix"):
        render.build(tmp_path)
    (tmp_path / "p.yaml").write_text("kind: Deployment\nmetadata: {name: ghost}\n")
    (tmp_path / "kustomization.yaml").write_text("patches:\n  - path: p.yaml\n")
    with pytest.raises(render.RenderError, match="no Deployment/ghost"):
        render.build(tmp_path)


def test_cluster_config_dials_peers_by_service_and_binds_every_interface():
    local = {"conductor": {"control_addr": "tcp://127.0.0.1:1", "heartbeat_addr":
                           "tcp://127.0.0.1:2", "cache_pools": "tcp://127.0.0.1:3"},
             "decode": {"control_addr": "tcp://127.0.0.1:4", "conductor_addr":
                        "tcp://127.0.0.1:1", "kv_host": "127.0.0.1"},
             "cache_pool": {"control_addr": "tcp://127.0.0.1:3", "ssd_dir": "var/x"}}
    out = render.cluster_config(local)
    assert out["conductor"] == {"control_addr": "tcp://0.0.0.0:1",
                                "heartbeat_addr": "tcp://0.0.0.0:2",
                                "cache_pools": "tcp://pdserve-cache-pool-0.pdserve-cache-pool:3"}
    assert out["decode"] == {"control_addr": "tcp://0.0.0.0:4",
                             "conductor_addr": "tcp://pdserve-conductor:1", "kv_host": "0.0.0.0"}
    assert out["cache_pool"]["ssd_dir"] == render.SSD_DIR
    local["decode"]["conductor_addr"] = "tcp://127.0.0.1:9"
    with pytest.raises(render.RenderError, match="nothing binds port 9"):
        render.cluster_config(local)
