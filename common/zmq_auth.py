"""Who may speak on the control plane: ZeroMQ CURVE keys per role, and a ZAP handler.

A keys directory (``pdserve keys --out DIR``) holds one CURVE key pair per role, in
ZeroMQ's certificate format: ``<name>.key`` (public) and ``<name>.key_secret`` (secret).

    roles     gateway conductor prefill decode unified cache-pool client
    servers   gateway conductor worker cache-pool

A process uses its role's pair as its identity when it connects. A socket it binds
presents the key of its *server identity*: the role itself, except that the three
worker roles share one ``worker`` pair, because a peer connecting to a worker address
(a Route's decode address names a decode or a unified worker) cannot know which role
it will meet. Who a connecting peer is, is still told apart by role.

:func:`make_context` builds a process's ZeroMQ context: with keys, a :class:`CurveContext`
whose ZAP handler admits only the public keys in the directory and sets each
connection's ZAP user id to the key's role; without, a plain context and one warning.
The socket helpers in ``common.zmq_io`` / ``common.zmq_rpc`` read the context's keys:
bound sockets become CURVE servers, connecting ones CURVE clients of the server
identity they name, and a receiver reads the sender's role with :func:`peer_role`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import structlog
import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from common.zmq_metrics import Refusals

log = structlog.get_logger(__name__)

WORKER_ROLES = ("prefill", "decode", "unified")
ROLES = ("gateway", "conductor", *WORKER_ROLES, "cache-pool", "client")
WORKER_SERVER = "worker"
KEY_NAMES = (*ROLES, WORKER_SERVER)
ZAP_DOMAIN = "pdserve"
PLAIN_WARNING = "control plane is unauthenticated: trusted single host only"

# The allowed message types per sender role, as each receiving endpoint declares them.
Policy = Mapping[str, frozenset[str]]


def server_identity(role: str) -> str:
    """The key name a bound socket of ``role`` presents."""
    return WORKER_SERVER if role in WORKER_ROLES else role


def generate_keys(out: str | Path) -> list[Path]:
    """Write a fresh key pair for every role and server identity into ``out``; secret
    files are readable by their owner only. Returns the files written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in KEY_NAMES:
        public, secret = zmq.auth.create_certificates(out, name)
        os.chmod(secret, 0o600)
        written += [Path(public), Path(secret)]
    return written


@dataclass(frozen=True, slots=True)
class KeyPair:
    public: bytes  # z85, as ZeroMQ's socket options take it
    secret: bytes


@dataclass(frozen=True, slots=True, eq=False)
class CurveKeys:
    """What one process needs: its own pair, the pair its bound sockets present, the
    role of every admitted public key, and the public key of every server identity."""

    role: str
    own: KeyPair
    server: KeyPair
    roles_by_key: Mapping[bytes, str]
    server_keys: Mapping[str, bytes]

    @classmethod
    def load(cls, keys_dir: str | Path, role: str) -> CurveKeys:
        """Read ``keys_dir`` for ``role``. Raises ValueError for an unknown role or a
        missing or unreadable key file."""
        if role not in ROLES:
            raise ValueError(f"no CURVE keys for role {role!r}; roles are {ROLES}")
        base = Path(keys_dir)
        publics = {name: _public(base, name) for name in KEY_NAMES}
        return cls(role=role, own=_pair(base, role), server=_pair(base, server_identity(role)),
                   roles_by_key=MappingProxyType({publics[r]: r for r in ROLES}),
                   server_keys=MappingProxyType(
                       {n: publics[n] for n in (*ROLES, WORKER_SERVER)}))

    def server_key(self, server: str) -> bytes:
        """The public key of the server identity (or role) ``server``."""
        try:
            return self.server_keys[server_identity(server)]
        except KeyError:
            raise ValueError(f"no server key for {server!r}") from None


def _public(base: Path, name: str) -> bytes:
    path = base / f"{name}.key"
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read CURVE key {path}: {exc}") from exc
    return public


def _pair(base: Path, name: str) -> KeyPair:
    path = base / f"{name}.key_secret"
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read CURVE secret key {path}: {exc}") from exc
    if secret is None:
        raise ValueError(f"{path} holds no secret key")
    return KeyPair(public, secret)


class _RoleAuthenticator(ThreadAuthenticator):
    """Admits the keys of ``roles_by_key``; the ZAP user id is the key's role."""

    def __init__(self, ctx: zmq.Context, roles_by_key: Mapping[bytes, str]) -> None:
        super().__init__(ctx)
        self._roles = roles_by_key
        self.denied = 0
        self._lock = threading.Lock()

    def callback(self, domain: str, z85_key: bytes) -> bool:
        if z85_key in self._roles:
            return True
        with self._lock:
            self.denied += 1
        log.warning("curve_peer_refused", key=z85_key.decode("ascii", "replace"))
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self._roles.get(z85.encode(client_public_key), "")


class CurveContext(zmq.asyncio.Context):
    """A context whose sockets speak CURVE with ``curve`` keys. Its ZAP handler runs
    from construction (a CURVE server with no handler would admit anyone) until
    ``term``/``destroy``."""

    curve: CurveKeys | None = None
    refusals: Refusals | None = None  # messages refused by role (common.zmq_metrics)
    _auth: _RoleAuthenticator | None = None

    def start_auth(self, keys: CurveKeys) -> None:
        self.curve = keys
        self.refusals = Refusals()
        auth = _RoleAuthenticator(zmq.Context.shadow(self.underlying), keys.roles_by_key)
        auth.start()
        auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=auth)
        self._auth = auth

    @property
    def refused(self) -> int:
        """Connections the ZAP handler refused (unknown keys)."""
        return self._auth.denied if self._auth is not None else 0

    def _stop_auth(self) -> None:
        auth, self._auth = self._auth, None
        if auth is not None:
            auth.stop()

    def term(self) -> None:
        self._stop_auth()
        super().term()

    def destroy(self, linger: int | None = None) -> None:
        self._stop_auth()
        super().destroy(linger)


def make_context(keys_dir: str, role: str) -> zmq.asyncio.Context:
    """The process's context: CURVE with the keys in ``keys_dir`` for ``role``, or plain
    (one warning) if ``keys_dir`` is empty. Raises ValueError for unreadable keys."""
    if not keys_dir:
        log.warning(PLAIN_WARNING, role=role)
        return zmq.asyncio.Context()
    keys = CurveKeys.load(keys_dir, role)
    ctx = CurveContext()
    ctx.start_auth(keys)
    log.info("control plane uses CURVE", role=role, keys_dir=keys_dir)
    return ctx


def keys_of(ctx: zmq.Context) -> CurveKeys | None:
    return getattr(ctx, "curve", None)


def secure_bind(ctx: zmq.Context, sock: zmq.Socket) -> bool:
    """Make ``sock`` (not yet bound) a CURVE server if ``ctx`` has keys; True if so."""
    keys = keys_of(ctx)
    if keys is None:
        return False
    sock.curve_secretkey = keys.server.secret
    sock.curve_publickey = keys.server.public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()
    return True


def secure_connect(ctx: zmq.Context, sock: zmq.Socket, server: str | None) -> None:
    """Make ``sock`` (not yet connected) a CURVE client of the server identity or role
    ``server`` if ``ctx`` has keys. Raises ValueError when keys are set and ``server``
    is not named: a connection must know whom it expects."""
    keys = keys_of(ctx)
    if keys is None:
        return
    if server is None:
        raise ValueError("a CURVE connection needs the server's role")
    sock.curve_serverkey = keys.server_key(server)
    sock.curve_publickey = keys.own.public
    sock.curve_secretkey = keys.own.secret


def peer_role(frame: zmq.Frame) -> str:
    """The role of the CURVE peer that sent ``frame`` (received with copy=False);
    "" if the connection carries no ZAP user id."""
    try:
        return frame.get("User-Id") or ""
    except zmq.ZMQError:
        return ""


def allows(policy: Policy, role: str, type_name: str) -> bool:
    return type_name in policy.get(role, ())
