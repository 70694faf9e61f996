"""Scaling through the Kubernetes API: the scale subresource of each role's Deployment.

    GET   /apis/apps/v1/namespaces/NS/deployments/NAME/scale      -> spec.replicas
    PATCH /apis/apps/v1/namespaces/NS/deployments/NAME/scale
          Content-Type: application/merge-patch+json  {"spec": {"replicas": n}}

In a pod: the API server from ``KUBERNETES_SERVICE_HOST``/``_PORT``, the service
account's token (read at every call: kubelet rotates it), CA and namespace from
/var/run/secrets/kubernetes.io/serviceaccount. The Role in deploy/k8s grants ``get``
and ``patch`` on exactly these two ``deployments/scale`` and nothing else.

Scaling in is the Deployment's: Kubernetes picks a pod and terminates it (SIGTERM, then
``terminationGracePeriodSeconds`` for the worker to drain). The count is the
Deployment's desired replicas, so a pod still starting counts. Plain urllib in a thread:
two calls a look need no client library.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import urllib.error
import urllib.request
from pathlib import Path

from services.planner.actuator import Actuator, ActuatorError

TIMEOUT_S = 10.0
MAX_BODY = 1 << 20  # a Scale object is a few hundred bytes


class KubernetesActuator(Actuator):
    name = "kubernetes"

    def __init__(self, deployments: dict[str, str], *, api: str = "", namespace: str = "",
                 token_file: str, ca_file: str = "") -> None:
        if not api:
            host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ActuatorError("k8s_api is empty and KUBERNETES_SERVICE_HOST unset: "
                                    "not in a pod; set k8s_api")
            api = f"https://{'[' + host + ']' if ':' in host else host}:{port}"
        if not namespace:
            ns_file = Path(token_file).with_name("namespace")
            try:
                namespace = ns_file.read_text().strip()
            except OSError as exc:
                raise ActuatorError(f"k8s_namespace is empty and {ns_file} unreadable: "
                                    f"{exc}") from exc
        self.api, self.namespace = api.rstrip("/"), namespace
        self._deployments = deployments
        self._token_file = token_file
        self._ssl = None
        if self.api.startswith("https://"):
            try:
                self._ssl = ssl.create_default_context(cafile=ca_file or None)
            except OSError as exc:
                raise ActuatorError(f"cannot read the API server's CA {ca_file}: {exc}") from exc

    def url(self, role: str) -> str:
        return (f"{self.api}/apis/apps/v1/namespaces/{self.namespace}/deployments/"
                f"{self._deployments[role]}/scale")

    def _request(self, role: str, method: str, body: dict | None = None) -> dict:
        try:
            token = Path(self._token_file).read_text().strip()
        except OSError as exc:
            raise ActuatorError(f"cannot read the service account token: {exc}") from exc
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/merge-patch+json"
        req = urllib.request.Request(self.url(role), data=data, method=method, headers=headers)
        what = f"{method} deployments/{self._deployments[role]}/scale"
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S, context=self._ssl) as resp:
                raw = resp.read(MAX_BODY + 1)
        except urllib.error.HTTPError as exc:
            raise ActuatorError(f"{what}: HTTP {exc.code} {_status_message(exc)}") from exc
        except (OSError, ValueError) as exc:
            raise ActuatorError(f"{what}: {exc}") from exc
        try:
            if len(raw) > MAX_BODY:
                raise ValueError("answer too large")
            scale = json.loads(raw)
            replicas = scale["spec"].get("replicas", 0)
            if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
                raise ValueError(f"spec.replicas {replicas!r}")
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ActuatorError(f"{what}: not a Scale object ({exc})") from exc
        return scale

    async def start(self) -> None:
        for role in self._deployments:
            await self.count(role)

    async def count(self, role: str) -> int:
        scale = await asyncio.to_thread(self._request, role, "GET")
        return scale["spec"].get("replicas", 0)

    async def scale(self, role: str, n: int) -> None:
        scale = await asyncio.to_thread(self._request, role, "PATCH",
                                        {"spec": {"replicas": n}})
        if scale["spec"].get("replicas", 0) != n:
            raise ActuatorError(f"deployments/{self._deployments[role]} answered replicas "
                                f"{scale['spec'].get('replicas')} for {n}")


def _status_message(exc: urllib.error.HTTPError) -> str:
    """The message of the API server's Status object, or the HTTP reason."""
    try:
        return str(json.loads(exc.read(MAX_BODY))["message"])[:300]
    except (ValueError, KeyError, TypeError, OSError):
        return str(exc.reason)
