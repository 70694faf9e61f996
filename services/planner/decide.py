"""The scaling policy: a pure object (time, counts and loads in; a decision out).

For each role, every look (``decide``)::

    count < min                      scale_out  "min"        at once, no cool-down
    count > max                      scale_in   "max"        at once
    pressure at count workers        scale_out  ttft|tbt|queue|kv
        prefill: ttft > up_ratio*SLO, or waiting per worker > queue_high
        decode:  tbt  > up_ratio*SLO, or waiting per worker > queue_high, or kv > kv_high
    idle at count - 1 workers        scale_in   "idle"
        every signal of the role stays under its low mark with one worker fewer:
        ttft, tbt < down_ratio*SLO, queue <= queue_low, kv < kv_low (decode)
    otherwise                        hold       "steady"

Hysteresis three ways: the high and low marks differ; scaling in is judged on the load
one worker fewer would carry, so it cannot undo the scale-out that load just caused;
and a condition must hold for ``up_ticks`` (``down_ticks``) consecutive looks. A
cool-down follows every change of a role: ``cooldown_up_s`` before it grows again (a
new worker takes time to register and take load), ``cooldown_down_s`` before it
shrinks. A role that should grow but may not says why: ``hold`` with reason
``at_max`` or ``cooldown``.

One step at a time (plus or minus one worker): the next look sees what the step did.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.planner.load import RoleLoad
from services.planner.settings import PlannerSettings

SCALE_OUT, SCALE_IN, HOLD = "scale_out", "scale_in", "hold"


@dataclass(frozen=True, slots=True)
class Decision:
    role: str
    action: str  # scale_out, scale_in or hold
    reason: str  # min, max, ttft, tbt, queue, kv, idle, at_max, cooldown, steady
    current: int
    target: int
    detail: str = ""  # the figures behind it, for the log

    @property
    def changes(self) -> bool:
        return self.target != self.current


@dataclass(slots=True)
class _RoleState:
    pressure_ticks: int = 0
    idle_ticks: int = 0
    last_change: float = field(default=float("-inf"))


class Planner:
    """Decides each role's worker count; remembers streaks and the last change."""

    def __init__(self, settings: PlannerSettings) -> None:
        self.s = settings
        self._state = {"prefill": _RoleState(), "decode": _RoleState()}

    def decide(self, role: str, count: int, load: RoleLoad, now: float) -> Decision:
        """What to do with ``role`` that runs ``count`` workers (the actuator's count)
        under ``load``, at time ``now`` (seconds, monotonic). A decision that changes
        the count starts the cool-down: the caller acts on it or the next look repeats
        it after the cool-down."""
        s, st = self.s, self._state[role]
        lo, hi = s.bounds(role)
        if count < lo:
            return self._change(role, count, count + 1, "min", f"below min {lo}", now)
        if count > hi:
            return self._change(role, count, count - 1, "max", f"above max {hi}", now)
        # Pressure on the workers serving now (one still starting carries nothing yet);
        # idleness of one worker fewer than the actuator runs.
        pressure = self._pressure(role, load.at(max(1, min(count, load.alive))))
        idle = self._idle(role, load, count - 1) if count > 0 else ""
        st.pressure_ticks = st.pressure_ticks + 1 if pressure else 0
        st.idle_ticks = st.idle_ticks + 1 if idle and not pressure else 0
        since = now - st.last_change
        if pressure:
            reason, detail = pressure
            if st.pressure_ticks < s.up_ticks:
                return Decision(role, HOLD, "steady", count, count, detail)
            if count >= hi:
                return Decision(role, HOLD, "at_max", count, count, detail)
            if since < s.cooldown_up_s:
                return Decision(role, HOLD, "cooldown", count, count, detail)
            return self._change(role, count, count + 1, reason, detail, now)
        if idle and st.idle_ticks >= s.down_ticks and count > lo \
                and since >= s.cooldown_down_s:
            return self._change(role, count, count - 1, "idle", idle, now)
        return Decision(role, HOLD, "steady", count, count)

    def _change(self, role: str, count: int, target: int, reason: str, detail: str,
                now: float) -> Decision:
        st = self._state[role]
        st.last_change, st.pressure_ticks, st.idle_ticks = now, 0, 0
        action = SCALE_OUT if target > count else SCALE_IN
        return Decision(role, action, reason, count, target, detail)

    def _pressure(self, role: str, p) -> tuple[str, str] | None:
        """(reason, detail) of the first signal over its high mark, or None."""
        s = self.s
        if role == "prefill" and s.slo_ttft_ms and p.ttft_s * 1e3 > s.up_ratio * s.slo_ttft_ms:
            return "ttft", f"ttft {p.ttft_s * 1e3:.0f}ms vs SLO {s.slo_ttft_ms:.0f}ms"
        if role == "decode" and s.slo_tbt_ms and p.tbt_s * 1e3 > s.up_ratio * s.slo_tbt_ms:
            return "tbt", f"tbt {p.tbt_s * 1e3:.1f}ms vs SLO {s.slo_tbt_ms:.0f}ms"
        if p.queue > s.queue_high:
            return "queue", f"{p.queue:.1f} waiting per worker > {s.queue_high}"
        if role == "decode" and p.kv > s.kv_high:
            return "kv", f"KV {p.kv:.0%} in use > {s.kv_high:.0%}"
        return None

    def _idle(self, role: str, load: RoleLoad, workers: int) -> str:
        """A description of the load on ``workers`` workers if every signal of the
        role stays under its low mark there; "" otherwise. No workers carry no load."""
        s = self.s
        if workers == 0:
            busy = load.waiting or load.running or load.queued_prefill_tokens
            return "" if busy else "no load"
        p = load.at(workers)
        if s.slo_ttft_ms and role == "prefill" and p.ttft_s * 1e3 >= s.down_ratio * s.slo_ttft_ms:
            return ""
        if s.slo_tbt_ms and role == "decode" and p.tbt_s * 1e3 >= s.down_ratio * s.slo_tbt_ms:
            return ""
        if p.queue > s.queue_low or (role == "decode" and p.kv >= s.kv_low):
            return ""
        return (f"with {p.workers}: {p.queue:.1f} waiting per worker, KV {p.kv:.0%}, "
                f"ttft {p.ttft_s * 1e3:.0f}ms, tbt {p.tbt_s * 1e3:.1f}ms")
