"""Render the Kubernetes manifests without a cluster and without kustomize, and derive the
ConfigMap's TOML from the one the other deployments use.

    python deploy/k8s/render.py build deploy/k8s/overlays/gpu   # YAML on stdout
    python deploy/k8s/render.py config                           # rewrite base/pdserve.toml

``build`` implements the part of kustomize these manifests use, and refuses anything
else: ``resources`` (files and directories), ``components``, ``patches`` (strategic
merge for the list keys in ``MERGE_KEYS``, or JSON 6902), ``configMapGenerator`` (files,
with kustomize's content-hash name suffix and the references to it rewritten) and
``images``. ``kubectl kustomize`` renders the same directories to the same objects.

``config`` turns deploy/configs/local.toml into the cluster's TOML: every address a
service binds listens on all interfaces, every address it dials names the Service of the
process that binds that port, and the cache pool keeps its SSD tier on its volume.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
import tomllib
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
LOCAL_TOML = HERE.parents[0] / "configs" / "local.toml"
CLUSTER_TOML = HERE / "base" / "pdserve.toml"

# Keys whose address a service binds (the conductor's heartbeat_addr too, below).
BIND_KEYS = ("control_addr", "events_addr", "zmq_addr", "stream_bind")
# How a peer reaches the process that binds a port: its Service, or for the cache pool
# its StatefulSet pod's stable name under the headless Service.
PEER_HOST = {"conductor": "pdserve-conductor",
             "cache_pool": "pdserve-cache-pool-0.pdserve-cache-pool"}
SSD_DIR = "/var/lib/pdserve/cache-pool"
POOL_KV_PORT = 5582  # fixed, so that the pod spec can declare it

MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name",
              "volumes": "name", "volumeMounts": "mountPath", "ports": "containerPort",
              "volumeClaimTemplates": None, "tolerations": None}
KNOWN_FIELDS = {"apiVersion", "kind", "resources", "components", "patches",
                "configMapGenerator", "generatorOptions", "images"}


class RenderError(ValueError):
    """A kustomization this renderer does not handle, or a patch without a target."""


# ---- the cluster's TOML ------------------------------------------------------------------

def _host_port(addr: str) -> tuple[str, int]:
    rest = addr.partition("://")[2]
    host, _, port = rest.rpartition(":")
    return host, int(port)


def cluster_config(local: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``local`` (one machine, loopback) as the cluster runs it."""
    binds: dict[int, str] = {}
    for section, table in local.items():
        for key, value in table.items():
            if key in BIND_KEYS or (section, key) == ("conductor", "heartbeat_addr"):
                binds[_host_port(value)[1]] = section
    out: dict[str, dict[str, Any]] = {}
    for section, table in local.items():
        new = {}
        for key, value in table.items():
            if isinstance(value, str) and value.startswith("tcp://"):
                addrs = []
                for addr in value.split(","):
                    _, port = _host_port(addr.strip())
                    owner = binds.get(port)
                    if owner is None:
                        raise RenderError(f"[{section}] {key}: nothing binds port {port}")
                    host = "0.0.0.0" if owner == section else PEER_HOST[owner]
                    addrs.append(f"tcp://{host}:{port}")
                value = ",".join(addrs)
            elif key in ("http_host", "kv_host"):
                value = "0.0.0.0"
            elif key == "ssd_dir":
                value = SSD_DIR
            new[key] = value
        if section == "cache_pool":
            new["kv_port"] = POOL_KV_PORT
        out[section] = new
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    raise RenderError(f"cannot write {value!r} as TOML here")


def dump_toml(config: dict[str, dict[str, Any]]) -> str:
    lines = ["# Generated from deploy/configs/local.toml by `python deploy/k8s/render.py config`;",
             "# do not edit: change local.toml (or set PDSERVE_* in a patch) and regenerate.",
             "# Binds listen on every interface of the pod; peers are dialled by Service name."]
    for section, table in config.items():
        lines += ["", f"[{section}]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def render_cluster_toml(local_toml: Path = LOCAL_TOML) -> str:
    return dump_toml(cluster_config(tomllib.loads(local_toml.read_text())))


# ---- kustomize, the part these manifests use ----------------------------------------------

def _load_yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kustomization(directory: Path) -> dict:
    path = directory / "kustomization.yaml"
    if not path.is_file():
        raise RenderError(f"{directory}: no kustomization.yaml")
    k = yaml.safe_load(path.read_text()) or {}
    unknown = set(k) - KNOWN_FIELDS
    if unknown:
        raise RenderError(f"{path}: fields this renderer does not handle: {sorted(unknown)}")
    return k


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """``patch`` merged into ``base``: maps key by key, lists named in MERGE_KEYS item by
    item on their key (new items first), every other list replaced; None deletes."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            if key.startswith("$"):
                raise RenderError(f"patch directive {key} is not supported")
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and MERGE_KEYS.get(field):
        key = MERGE_KEYS[field]
        out, new = list(base), []
        for item in patch:
            at = next((i for i, b in enumerate(out) if b.get(key) == item.get(key)), None)
            if at is None:
                new.append(copy.deepcopy(item))
            else:
                out[at] = strategic_merge(out[at], item)
        return new + out  # as kustomize: items only the patch has come first
    return copy.deepcopy(patch)


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def json6902(doc: dict, ops: list[dict]) -> dict:
    """``ops`` (add, replace, remove) applied to a copy of ``doc``."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = _pointer(op["path"])
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if op["op"] not in ("add", "replace", "remove"):
            raise RenderError(f"JSON patch op {op['op']!r} is not supported")
        if isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if op["op"] == "remove":
                del node[index]
            elif op["op"] == "add":
                node.insert(index, copy.deepcopy(op["value"]))
            else:
                node[index] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del node[last]
        else:
            if op["op"] == "replace" and last not in node:
                raise RenderError(f"JSON patch replaces missing {op['path']}")
            node[last] = copy.deepcopy(op["value"])
    return doc


def _find(resources: list[dict], kind: str, name: str, where: str) -> int:
    for i, r in enumerate(resources):
        if r["kind"] == kind and r["metadata"]["name"] == name:
            return i
    raise RenderError(f"{where}: no {kind}/{name} to patch")


def _apply_patches(directory: Path, patches: list[dict], resources: list[dict]) -> None:
    for entry in patches:
        if "path" in entry:
            where = str(directory / entry["path"])
            docs = _load_yaml_docs(directory / entry["path"])
        elif "patch" in entry:
            where = f"{directory}: inline patch"
            docs = [d for d in yaml.safe_load_all(entry["patch"]) if d]
        else:
            raise RenderError(f"{directory}: a patch needs path or patch")
        target = entry.get("target")
        if target is not None:  # JSON 6902 against one named object
            ops = docs[0] if len(docs) == 1 and isinstance(docs[0], list) else None
            if ops is None:
                raise RenderError(f"{where}: a targeted patch must be one JSON 6902 list")
            i = _find(resources, target["kind"], target["name"], where)
            resources[i] = json6902(resources[i], ops)
            continue
        for doc in docs:
            i = _find(resources, doc["kind"], doc["metadata"]["name"], where)
            resources[i] = strategic_merge(resources[i], doc)


def _go_json(value: Any) -> str:
    """JSON as Go's encoding/json writes it: sorted keys, no spaces, HTML escaped."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                    ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return text


def config_map_hash(cm: dict) -> str:
    """kustomize's name suffix for a generated ConfigMap: a hash of its content (kustomize 5
    hashes an empty name, so equal data under two names gets one suffix)."""
    digest = hashlib.sha256(_go_json({"kind": "ConfigMap", "name": "",
                                      "data": cm.get("data", {})}).encode()).hexdigest()
    return digest[:10].translate(str.maketrans("013ae", "ghkmt"))


def _generate_config_maps(directory: Path, k: dict) -> tuple[list[dict], dict[str, str]]:
    if set(k.get("generatorOptions", {})) - {"labels"}:
        raise RenderError(f"{directory}: only generatorOptions.labels is supported")
    labels = k.get("generatorOptions", {}).get("labels")
    out, names = [], {}
    for gen in k.get("configMapGenerator", []):
        if set(gen) - {"name", "files"}:
            raise RenderError(f"{directory}: configMapGenerator takes name and files only")
        data = {}
        for f in gen["files"]:
            key, _, rel = f.partition("=") if "=" in f else (Path(f).name, "", f)
            data[key] = (directory / rel).read_text()
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]},
              "data": data}
        if labels:
            cm["metadata"]["labels"] = dict(labels)
        names[gen["name"]] = cm["metadata"]["name"] = f"{gen['name']}-{config_map_hash(cm)}"
        out.append(cm)
    return out, names


def _rename_config_maps(doc: Any, names: dict[str, str]) -> None:
    """Point volumes, envFrom and env references at the generated (suffixed) names."""
    if isinstance(doc, dict):
        for key in ("configMap", "configMapRef", "configMapKeyRef"):
            ref = doc.get(key)
            if isinstance(ref, dict) and ref.get("name") in names:
                ref["name"] = names[ref["name"]]
        for value in doc.values():
            _rename_config_maps(value, names)
    elif isinstance(doc, list):
        for value in doc:
            _rename_config_maps(value, names)


def _set_images(doc: Any, images: list[dict]) -> None:
    if isinstance(doc, dict):
        for c in doc.get("containers", []) + doc.get("initContainers", []):
            name = c["image"].split(":")[0]
            for img in images:
                if img["name"] == name:
                    tag = img.get("newTag", c["image"].partition(":")[2])
                    c["image"] = img.get("newName", name) + (f":{tag}" if tag else "")
        for value in doc.values():
            _set_images(value, images)
    elif isinstance(doc, list):
        for value in doc:
            _set_images(value, images)


def build(directory: str | Path, resources: list[dict] | None = None) -> list[dict]:
    """The objects ``directory``'s kustomization renders to (a Component is applied to
    ``resources``, the objects built so far)."""
    directory = Path(directory).resolve()
    k = _kustomization(directory)
    is_component = k.get("kind") == "Component"
    out: list[dict] = list(resources or []) if is_component else []
    for entry in k.get("resources", []):
        path = directory / entry
        out += build(path) if path.is_dir() else _load_yaml_docs(path)
    for entry in k.get("components", []):
        out = build(directory / entry, out)
    generated, names = _generate_config_maps(directory, k)
    for doc in out:
        _rename_config_maps(doc, names)
    out += generated
    _apply_patches(directory, k.get("patches", []), out)
    for doc in out:
        _set_images(doc, k.get("images", []))
    seen = set()
    for doc in out:
        ident = (doc["kind"], doc["metadata"]["name"])
        if ident in seen:
            raise RenderError(f"{directory}: {ident[0]}/{ident[1]} defined twice")
        seen.add(ident)
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["config"]:
        CLUSTER_TOML.write_text(render_cluster_toml())
        print(f"wrote {CLUSTER_TOML}")
        return 0
    if len(argv) == 2 and argv[0] == "build":
        yaml.safe_dump_all(build(argv[1]), sys.stdout, sort_keys=False)
        return 0
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
