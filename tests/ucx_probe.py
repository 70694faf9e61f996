"""Whether this machine's ucxx can run the ucx backend: ``UCX_MISSING`` is None when it
can, else the reason the transfer tests skip their ucx cases."""

from __future__ import annotations

from common.transfer import BackendUnavailable
from common.transfer.ucx import load_ucxx

try:
    load_ucxx()
    UCX_MISSING: str | None = None
except BackendUnavailable as exc:
    UCX_MISSING = str(exc)
