"""The planner's actuators against what they drive: the Kubernetes actuator against a fake
API server (the scale subresource: GET, then PATCH as a merge patch with the service
account's token), the supervisord actuator against a real supervisord with spare
programs, the local actuator with real processes."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.planner.actuator import ActuatorError
from services.planner.kubernetes import KubernetesActuator
from services.planner.local import LocalActuator
from services.planner.supervisor import SupervisorActuator

pytestmark = pytest.mark.timeout(120)

TOKEN = "sa-token-1"
SCALE_PATH = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"


class FakeApi:
    """An API server holding Deployments' replicas; records every request."""

    def __init__(self, namespace: str, replicas: dict[str, int]) -> None:
        self.namespace, self.replicas, self.requests = namespace, dict(replicas), []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, code, body):
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _handle(self, method):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                api.requests.append((method, self.path, dict(self.headers), body))
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._answer(401, {"kind": "Status", "message": "Unauthorized"})
                name = next((n for n in api.replicas if self.path == SCALE_PATH.format(
                    ns=api.namespace, name=n)), None)
                if name is None:
                    return self._answer(404, {"kind": "Status", "message":
                                              f'deployments.apps "{self.path}" not found'})
                if method == "PATCH":
                    if self.headers.get("Content-Type") != "application/merge-patch+json":
                        return self._answer(415, {"kind": "Status", "message": "media type"})
                    api.replicas[name] = json.loads(body)["spec"]["replicas"]
                self._answer(200, {"kind": "Scale", "apiVersion": "autoscaling/v1",
                                   "metadata": {"name": name, "namespace": api.namespace},
                                   "spec": {"replicas": api.replicas[name]},
                                   "status": {"replicas": api.replicas[name]}})

            def do_GET(self):
                self._handle("GET")

            def do_PATCH(self):
                self._handle("PATCH")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api():
    fake = FakeApi("serving", {"pdserve-prefill": 1, "pdserve-decode": 2})
    yield fake
    fake.close()


def sa_dir(tmp_path, token=TOKEN, namespace="serving"):
    (tmp_path / "token").write_text(token + "\n")
    (tmp_path / "namespace").write_text(namespace)
    return str(tmp_path / "token")


def k8s(api, token_file, **kw):
    return KubernetesActuator({"prefill": "pdserve-prefill", "decode": "pdserve-decode"},
                              api=api.url, token_file=token_file, **kw)


def test_kubernetes_actuator_patches_the_scale_subresource(api, tmp_path):
    act = k8s(api, sa_dir(tmp_path))  # the namespace comes from the service account
    assert act.namespace == "serving"

    async def go():
        await act.start()
        assert (await act.count("prefill"), await act.count("decode")) == (1, 2)
        await act.scale("decode", 3)
        await act.scale("prefill", 0)
        return await act.count("decode")
    assert asyncio.run(go()) == 3
    assert api.replicas == {"pdserve-prefill": 0, "pdserve-decode": 3}
    patches = [(p, h, b) for m, p, h, b in api.requests if m == "PATCH"]
    assert [(p, json.loads(b)) for p, _, b in patches] == [
        ("/apis/apps/v1/namespaces/serving/deployments/pdserve-decode/scale",
         {"spec": {"replicas": 3}}),
        ("/apis/apps/v1/namespaces/serving/deployments/pdserve-prefill/scale",
         {"spec": {"replicas": 0}})]
    assert all(h["Content-Type"] == "application/merge-patch+json"
               and h["Authorization"] == f"Bearer {TOKEN}" for _, h, _ in patches)


def test_kubernetes_actuator_rereads_a_rotated_token_and_reports_refusals(api, tmp_path):
    token_file = sa_dir(tmp_path, token="stale")
    act = k8s(api, token_file)
    with pytest.raises(ActuatorError, match="HTTP 401 Unauthorized"):
        asyncio.run(act.count("decode"))
    (tmp_path / "token").write_text(TOKEN)  # kubelet rotated it
    assert asyncio.run(act.count("decode")) == 2
    missing = KubernetesActuator({"prefill": "nope", "decode": "pdserve-decode"},
                                 api=api.url, namespace="serving", token_file=token_file)
    with pytest.raises(ActuatorError, match='HTTP 404 deployments.apps .*not found'):
        asyncio.run(missing.start())
    assert api.replicas == {"pdserve-prefill": 1, "pdserve-decode": 2}  # nothing changed


def test_kubernetes_actuator_outside_a_pod_needs_an_api_address(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ActuatorError, match="KUBERNETES_SERVICE_HOST"):
        KubernetesActuator({}, token_file=sa_dir(tmp_path))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    act = KubernetesActuator({"decode": "d"}, token_file=sa_dir(tmp_path))
    assert act.url("decode") == ("https://10.0.0.1:443/apis/apps/v1/namespaces/serving/"
                                 "deployments/d/scale")


def test_kubernetes_actuator_refuses_an_answer_that_is_no_scale(tmp_path):
    class Junk(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"spec": {"replicas": "many"}}')
    server = ThreadingHTTPServer(("127.0.0.1", 0), Junk)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        act = KubernetesActuator({"decode": "d"}, api=f"http://127.0.0.1:{server.server_port}",
                                 namespace="x", token_file=sa_dir(tmp_path))
        with pytest.raises(ActuatorError, match="not a Scale object"):
            asyncio.run(act.count("decode"))
    finally:
        server.shutdown()
        server.server_close()


SLEEPER = f"{sys.executable} -c 'import signal, sys, time; " \
          "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); time.sleep(600)'"


def wait_for(pred, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


def test_supervisord_actuator_starts_and_stops_spare_programs(tmp_path):
    sock = tmp_path / "supervisor.sock"
    programs = "".join(
        f"[program:{name}]\ncommand={SLEEPER}\nautostart={'true' if name == 'decode' else 'false'}"
        f"\nautorestart=false\nstartsecs=0\nstopwaitsecs=10\n"
        for name in ("decode", "decode-2", "decode-3", "prefill"))
    conf = tmp_path / "supervisord.conf"
    conf.write_text(
        f"[supervisord]\nnodaemon=true\nlogfile={tmp_path}/sd.log\npidfile={tmp_path}/sd.pid\n"
        f"childlogdir={tmp_path}\n[unix_http_server]\nfile={sock}\nchmod=0700\n"
        "[rpcinterface:supervisor]\n"
        "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface\n"
        + programs)
    proc = subprocess.Popen([sys.executable, "-m", "supervisor.supervisord", "-c", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(sock.exists)
        url = f"unix://{sock}"
        act = SupervisorActuator(url, {"prefill": ("prefill",),
                                       "decode": ("decode", "decode-2", "decode-3")})

        async def counts():
            return await act.count("prefill"), await act.count("decode")

        asyncio.run(act.start())
        assert wait_for(lambda: asyncio.run(counts()) == (0, 1))
        asyncio.run(act.scale("decode", 3))
        assert asyncio.run(counts()) == (0, 3)
        assert wait_for(lambda: all(
            i["statename"] == "RUNNING" for i in act._call("getAllProcessInfo")
            if i["name"].startswith("decode")))
        asyncio.run(act.scale("decode", 1))  # stops the last started: decode-3, decode-2
        assert wait_for(lambda: asyncio.run(counts()) == (0, 1))  # STOPPING counts out

        def states() -> dict:
            return {i["name"]: i["statename"] for i in act._call("getAllProcessInfo")}

        assert wait_for(lambda: states() == {"decode": "RUNNING", "decode-2": "STOPPED",
                                             "decode-3": "STOPPED", "prefill": "STOPPED"})
        bad = SupervisorActuator(url, {"prefill": ("prefill",), "decode": ("decode-9",)})
        with pytest.raises(ActuatorError, match=r"no programs \['decode-9'\]"):
            asyncio.run(bad.start())
        with pytest.raises(ActuatorError, match="supervisord at unix:///nonexistent"):
            asyncio.run(SupervisorActuator("unix:///nonexistent.sock", {}).start())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_local_actuator_starts_newest_last_and_stops_newest_first(tmp_path):
    act = LocalActuator(SLEEPER + " {role} {name}", str(tmp_path / "logs"))

    async def go():
        await act.start()
        await act.scale("decode", 2)
        await act.scale("prefill", 1)
        first = [w.popen.args[-1] for w in act._workers["decode"]]
        counts = (await act.count("prefill"), await act.count("decode"))
        await act.scale("decode", 1)
        stopping = [w for w in act._workers["decode"] if w.stopping]
        after = await act.count("decode")
        stopping[0].popen.wait(10)
        kept = act._workers["decode"][0]
        kept.popen.kill()  # a worker that dies is no longer counted
        kept.popen.wait(10)
        died = await act.count("decode")
        await act.close()
        return first, counts, [w.name for w in stopping], after, died
    first, counts, stopped, after, died = asyncio.run(go())
    assert first == ["decode-p1", "decode-p2"] and counts == (1, 2)
    assert stopped == ["decode-p2"] and after == 1 and died == 0
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "decode-p1.log", "decode-p2.log", "prefill-p3.log"]
    with pytest.raises(ActuatorError, match="placeholder"):
        asyncio.run(LocalActuator("{python} -m services.{rol}").start())
