"""The planner's Kubernetes objects (deploy/k8s/components/planner, in overlays/planner):
valid against the API schemas, and in step with the planner's settings and the rest of
the deployment: the Deployments it scales exist, its Role grants exactly the scale
subresource of those two, its pod runs under that Role's service account, dials the
conductor's Service, and mounts the client role's CURVE keys."""

from __future__ import annotations

import shutil

import kubernetes_validate

from common.address import parse_address
from common.config import load_settings
from common.zmq_auth import CurveKeys, generate_keys
from services.planner.settings import PlannerSettings
from tests.test_k8s import K8S, KUBE_VERSION, by_name, render

OVERLAY = K8S / "overlays" / "planner"


def planner_settings(c: dict) -> PlannerSettings:
    assert c["command"] == ["pdserve"] and c["args"][0] == "planner"
    env = {e["name"]: e["value"] for e in c["env"]}
    return load_settings(PlannerSettings, "planner", c["args"][1:], env=env)


def test_every_planner_object_is_valid_and_the_base_is_unchanged():
    objects = render.build(OVERLAY)
    for obj in objects:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    planner = {k for k in by_name(objects)} - set(by_name(render.build(K8S / "overlays/cpu")))
    assert planner == {("ServiceAccount", "pdserve-planner"), ("Role", "pdserve-planner"),
                       ("RoleBinding", "pdserve-planner"), ("Deployment", "pdserve-planner")}


def test_the_planner_scales_the_worker_deployments_it_may_patch_and_no_more():
    named = by_name(render.build(OVERLAY))
    dep = named[("Deployment", "pdserve-planner")]
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    s = planner_settings(c)
    assert s.actuator == "kubernetes" and s.k8s_api == "" and s.k8s_namespace == ""
    targets = {s.k8s_prefill, s.k8s_decode}
    for name, role in ((s.k8s_prefill, "prefill"), (s.k8s_decode, "decode")):
        worker = named[("Deployment", name)]
        assert worker["spec"]["template"]["spec"]["containers"][0]["args"][0] == role
        lo, hi = s.bounds(role)
        assert lo <= worker["spec"]["replicas"] <= hi
    role = named[("Role", "pdserve-planner")]
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments/scale"],
                              "resourceNames": sorted(targets, reverse=True),
                              "verbs": ["get", "patch"]}]
    binding = named[("RoleBinding", "pdserve-planner")]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "pdserve-planner"}
    assert binding["subjects"] == [{"kind": "ServiceAccount",
                                    "name": spec["serviceAccountName"]}]
    assert ("ServiceAccount", spec["serviceAccountName"]) in named
    assert spec.get("automountServiceAccountToken", True)
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"


def test_the_planner_dials_the_conductor_service_and_serves_its_metrics(tmp_path):
    named = by_name(render.build(OVERLAY))
    dep = named[("Deployment", "pdserve-planner")]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    s = planner_settings(c)
    addr = parse_address(s.conductor_addr)
    svc = named[("Service", addr.host)]
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "conductor"
    assert addr.port in {p["port"] for p in svc["spec"]["ports"] if p["name"] == "control"}
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert s.metrics_host == "0.0.0.0"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"metrics": s.metrics_port}
    assert int(ann["prometheus.io/port"]) == s.metrics_port
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    # The client role's keys and no other secret.
    keys = tmp_path / "all"
    generate_keys(keys)
    (vol,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "keys"]
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    for item in vol["secret"]["items"]:
        shutil.copy(keys / item["key"], mounted / item["path"])
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert s.curve_keys_dir == mounts["keys"]
    CurveKeys.load(mounted, "client")
    assert {p.name for p in mounted.glob("*.key_secret")} == {"client.key_secret"}
