"""Builds the actuator the settings name (the interface is ``actuator.py``)."""

from __future__ import annotations

from services.planner.actuator import Actuator, NoActuator
from services.planner.kubernetes import KubernetesActuator
from services.planner.local import LocalActuator
from services.planner.settings import PlannerSettings
from services.planner.supervisor import SupervisorActuator


def make_actuator(s: PlannerSettings) -> Actuator:
    if s.actuator == "supervisord":
        return SupervisorActuator(s.supervisor_url, {"prefill": s.supervisor_prefill,
                                                     "decode": s.supervisor_decode})
    if s.actuator == "kubernetes":
        return KubernetesActuator({"prefill": s.k8s_prefill, "decode": s.k8s_decode},
                                  api=s.k8s_api, namespace=s.k8s_namespace,
                                  token_file=s.k8s_token_file, ca_file=s.k8s_ca_file)
    if s.actuator == "local":
        return LocalActuator(s.local_command, s.local_log_dir)
    return NoActuator({"prefill": s.min_prefill, "decode": s.min_decode})
