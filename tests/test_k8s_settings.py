"""The Kubernetes manifests agree with the services' settings, as test_deploy_configs does
for supervisord and systemd: each container's settings are loaded the way the process
loads them (the ConfigMap's TOML, the pod's environment with the downward API filled in,
its arguments) and every port, address, probe, key, volume and grace period in the
manifest is checked against them."""

from __future__ import annotations

import re
import shutil
import tomllib

import pytest

from common import service_main
from common.address import is_wildcard, parse_address
from common.config import load_settings
from common.zmq_auth import CurveKeys, generate_keys
from services.cache_pool.settings import PoolSettings
from services.conductor.server import ConductorSettings
from services.gateway.server import GatewaySettings
from services.worker.settings import WorkerSettings
from tests.test_k8s import K8S, OVERLAYS, by_name, render

SETTINGS = {"conductor": ConductorSettings, "gateway": GatewaySettings,
            "prefill": WorkerSettings, "decode": WorkerSettings, "cache_pool": PoolSettings}
POD_IP = "10.1.2.3"
# What a planned stop may take (services/worker/server.py hand_back): telling the
# conductor (2 s), flushing the token streams (2 s); a prefill worker drains within
# kv_lease_s, a decode worker moves its requests' KV within it. MARGIN covers closing
# sockets and the engine thread.
LEAVING_S, FLUSH_S, MARGIN_S = 2.0, 2.0, 5.0
POOL_FLUSH_MIBS = 20.0  # slowest SSD write speed the pool's grace period allows for


def _port(addr: str) -> int:
    return parse_address(addr).port


def _expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], text)


def workloads(objects):
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def load_container(obj: dict, objects: list[dict], tmp_path):
    """(section, settings, container, pod spec) as the process in ``obj`` sees them."""
    spec = obj["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["command"] == ["pdserve"]
    section = c["args"][0].replace("-", "_")
    pod_name = obj["metadata"]["name"] + "-0"
    env: dict[str, str] = {}
    for e in c["env"]:  # in order: $(VAR) sees only the variables defined before it
        if "valueFrom" in e:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            env[e["name"]] = {"status.podIP": POD_IP, "metadata.name": pod_name}[path]
        else:
            env[e["name"]] = _expand(e["value"], env)
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    cm_name = volumes["config"]["configMap"]["name"]
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == cm_name]
    assert env["PDSERVE_CONFIG"] == mounts["config"] + "/pdserve.toml"
    config = tmp_path / "pdserve.toml"
    config.write_text(cm["data"]["pdserve.toml"])
    env["PDSERVE_CONFIG"] = str(config)
    argv = [_expand(a, env) for a in c["args"][1:]]
    settings = load_settings(SETTINGS[section], section, argv, env=env)
    assert env.get("PDSERVE_CURVE_KEYS_DIR") == mounts["keys"] == settings.curve_keys_dir
    return section, settings, c, spec


def bound_ports(section: str, s) -> dict[str, int]:
    """The ports the process binds, by the container port name the manifests use."""
    if section == "gateway":
        return {"http": s.http_port, "zmq": _port(s.zmq_addr), "streams": _port(s.stream_bind)}
    ports = {"control": _port(s.control_addr), "metrics": s.metrics_port}
    if section == "conductor":
        ports["heartbeats"] = _port(s.heartbeat_addr)
    if section == "decode":
        ports["kv"] = s.kv_port
    if section == "cache_pool":
        ports |= {"events": _port(s.events_addr), "kv": s.kv_port}
    return ports


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_probes_and_annotations_match_the_settings(overlay, tmp_path):
    objects = render.build(K8S / overlay)
    seen = set()
    for obj in workloads(objects):
        section, s, c, _ = load_container(obj, objects, tmp_path)
        seen.add(section)
        ports = bound_ports(section, s)
        declared = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert declared == ports, (section, declared, ports)
        # Peers in other pods reach every bind: all interfaces, not loopback.
        binds = [s.http_host] if section == "gateway" else [parse_address(s.control_addr).host]
        assert all(is_wildcard(h) for h in binds), (section, binds)
        metrics = "http" if section == "gateway" else "metrics"
        ann = obj["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true"
        assert int(ann["prometheus.io/port"]) == ports[metrics]
        assert ann["prometheus.io/path"] == "/metrics"
        for probe in ("livenessProbe", "readinessProbe"):
            get = c[probe]["httpGet"]
            assert get["port"] in declared, (section, probe)
            want = "/health" if (section, probe) == ("gateway", "readinessProbe") else "/metrics"
            assert (get["port"], get["path"]) == (metrics, want), (section, probe)
    assert seen == set(SETTINGS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_peers_dial_services_that_reach_the_process_binding_that_port(overlay, tmp_path):
    objects = render.build(K8S / overlay)
    named = by_name(objects)
    loaded = {}
    for o in workloads(objects):
        section, settings, _, _ = load_container(o, objects, tmp_path)
        loaded[section] = (o, settings)

    def pods_behind(host: str) -> tuple[dict, set[int]]:
        """The workload a DNS name reaches and the Service ports it offers."""
        if "." in host:  # <statefulset>-<n>.<headless service>
            pod, svc_name = host.split(".")
            svc = named[("Service", svc_name)]
            sts = [o for o in workloads(objects) if o["kind"] == "StatefulSet"
                   and o["spec"]["serviceName"] == svc_name]
            assert len(sts) == 1 and svc["spec"]["clusterIP"] == "None"
            ordinal = int(pod.rsplit("-", 1)[1])
            assert pod == f"{sts[0]['metadata']['name']}-{ordinal}"
            assert ordinal < sts[0]["spec"]["replicas"]
            return sts[0], {p["port"] for p in svc["spec"]["ports"]}
        svc = named[("Service", host)]
        sel = svc["spec"]["selector"]
        (target,) = [o for o in workloads(objects)
                     if sel.items() <= o["spec"]["template"]["metadata"]["labels"].items()]
        return target, {p["port"] for p in svc["spec"]["ports"]}

    dialled = []
    for section, (_, s) in loaded.items():
        addrs = [s.conductor_addr] if hasattr(s, "conductor_addr") else []
        if section in ("prefill", "decode"):
            addrs.append(s.heartbeat_addr)
        addrs += [a for a in getattr(s, "cache_pools", "").split(",") if a]
        for addr in addrs:
            host, port = parse_address(addr).host, parse_address(addr).port
            target, service_ports = pods_behind(host)
            (owner,) = [sec for sec, (o, _) in loaded.items() if o is target]
            assert port in service_ports, (section, addr)
            assert port in bound_ports(owner, loaded[owner][1]).values(), (section, addr)
            dialled.append((section, owner))
    assert ("gateway", "conductor") in dialled and ("decode", "cache_pool") in dialled
    assert ("prefill", "conductor") in dialled and ("conductor", "cache_pool") in dialled


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_and_gateways_advertise_their_pod_ip(overlay, tmp_path):
    objects = render.build(K8S / overlay)
    for obj in workloads(objects):
        section, s, c, _ = load_container(obj, objects, tmp_path)
        if section in ("prefill", "decode"):
            assert s.advertise_host == POD_IP
        if section == "gateway":
            assert s.stream_advertise == f"tcp://{POD_IP}:{_port(s.stream_bind)}"
        if section == "cache_pool":
            assert s.instance_id == obj["metadata"]["name"] + "-0"  # its stable pod name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_periods_cover_each_process_drain(overlay, tmp_path):
    objects = render.build(K8S / overlay)
    for obj in workloads(objects):
        section, s, c, spec = load_container(obj, objects, tmp_path)
        grace = spec["terminationGracePeriodSeconds"]
        if section == "gateway":
            pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
            need = pre_stop + s.shutdown_grace_s + MARGIN_S
        elif section == "prefill":
            need = LEAVING_S + s.kv_lease_s + MARGIN_S
        elif section == "decode":
            need = LEAVING_S + s.kv_lease_s + FLUSH_S + MARGIN_S
        elif section == "cache_pool":
            need = (s.dram_mib / POOL_FLUSH_MIBS if s.flush_on_close else 0) + MARGIN_S
        else:
            need = MARGIN_S
        assert grace >= need, (section, grace, need)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_reports_why_it_ended(overlay, tmp_path):
    """Kubernetes restarts a refused worker whatever its exit code (78, EX_CONFIG); the
    reason at least shows in the pod's status: the process writes /dev/termination-log
    (common/service_main.py), or the log's tail stands in."""
    objects = render.build(K8S / overlay)
    assert workloads(objects)
    for obj in workloads(objects):
        (c,) = obj["spec"]["template"]["spec"]["containers"]
        assert c["terminationMessagePolicy"] == "FallbackToLogsOnError", obj["metadata"]["name"]
        assert c.get("terminationMessagePath", "/dev/termination-log") == str(
            service_main.TERMINATION_LOG)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pool_keeps_its_ssd_tier_on_its_claim(overlay, tmp_path):
    objects = render.build(K8S / overlay)
    (sts,) = [o for o in objects if o["kind"] == "StatefulSet"]
    _, s, c, _ = load_container(sts, objects, tmp_path)
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert s.ssd_dir.startswith(mount["mountPath"] + "/")
    size = claim["spec"]["resources"]["requests"]["storage"]
    assert size.endswith("Gi") and int(size[:-2]) * 1024 > s.ssd_mib


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_pod_gets_the_curve_keys_its_role_needs_and_no_other_secret(overlay, tmp_path):
    keys = tmp_path / "all-keys"
    generate_keys(keys)
    objects = render.build(K8S / overlay)
    for obj in workloads(objects):
        section, s, c, spec = load_container(obj, objects, tmp_path)
        (vol,) = [v for v in spec["volumes"] if v["name"] == "keys"]
        assert vol["secret"]["secretName"] == "pdserve-curve-keys"
        mounted = tmp_path / f"mounted-{section}"
        mounted.mkdir()
        for item in vol["secret"]["items"]:
            shutil.copy(keys / item["key"], mounted / item["path"])
        role = section.replace("_", "-")
        CurveKeys.load(mounted, role)  # raises if a file it reads is missing
        secrets = {p.name for p in mounted.glob("*.key_secret")}
        want = {f"{role}.key_secret"} | ({"worker.key_secret"}
                                          if section in ("prefill", "decode") else set())
        assert secrets == want, (section, secrets)


def test_gpu_overlay_gives_each_worker_a_gpu_and_cpu_overlay_threads_its_cores(tmp_path):
    for overlay, device in (("overlays/gpu", "cuda"), ("overlays/cpu", "cpu")):
        objects = render.build(K8S / overlay)
        for obj in workloads(objects):
            section, s, c, _ = load_container(obj, objects, tmp_path)
            res = c["resources"]
            if section not in ("prefill", "decode"):
                assert "nvidia.com/gpu" not in res.get("limits", {})
                continue
            assert s.device == device
            if device == "cuda":
                assert res["limits"]["nvidia.com/gpu"] == 1
            else:
                assert s.num_threads == int(res["requests"]["cpu"]) == int(res["limits"]["cpu"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_pdbs_and_the_headless_worker_service_select_real_pods(overlay):
    objects = render.build(K8S / overlay)
    pods = {o["metadata"]["name"]: o["spec"]["template"] for o in workloads(objects)}

    def selected(sel):
        return {n for n, t in pods.items() if sel.items() <= t["metadata"]["labels"].items()}

    for o in objects:
        if o["kind"] == "Service":
            hit = selected(o["spec"]["selector"])
            assert hit, o["metadata"]["name"]
            for port in o["spec"]["ports"]:
                for name in hit:
                    names = {p["name"] for c in pods[name]["spec"]["containers"]
                             for p in c["ports"]}
                    assert port["targetPort"] in names, (o["metadata"]["name"], name, port)
        if o["kind"] == "PodDisruptionBudget":
            assert selected(o["spec"]["selector"]["matchLabels"]) == {o["metadata"]["name"]}
    workers = by_name(objects)[("Service", "pdserve-workers")]
    assert workers["spec"]["clusterIP"] == "None"
    assert selected(workers["spec"]["selector"]) == {"pdserve-prefill", "pdserve-decode"}
    conductor = by_name(objects)[("Deployment", "pdserve-conductor")]
    assert conductor["spec"]["replicas"] == 1
    assert conductor["spec"]["strategy"]["type"] == "Recreate"


def test_local_toml_sections_all_run_in_the_cluster():
    local = tomllib.loads((K8S.parent / "configs" / "local.toml").read_text())
    objects = render.build(K8S / "overlays/cpu")
    sections = {o["spec"]["template"]["spec"]["containers"][0]["args"][0].replace("-", "_")
                for o in workloads(objects)}
    assert sections == set(local)
