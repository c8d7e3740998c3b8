"""The budget mode's loop, per input shape: measure a step (nothing offloaded), measure the same step with
the offloader out of the way, choose a plan from both, then measure the steps that run with it, each
paired with a step without it, and shrink it until it adds no more than ``max_overhead``
(``_budget.PrefixSearch``).

The plan's forward pass is the reference steps' (both mark the end of the last decoder layer), its backward
the rest of their step: the measured step's hooks stretch its forward pass alone (:func:`forward_scale`).

The step without the offloader is the reference because the measured step is not: recording what every
scope saves costs time of its own, and the first step of a process pays for warming caches. A plan checked
against either would pass while adding more than it may. Shapes are keyed by a power-of-two bucket of the
first decoder layer's input, so a new sequence-length bucket is measured and planned on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from . import _budget, _scopes
from ._pool import HostPool

PROFILE = "profile"  # record what each scope saves and when; nothing offloaded
BASELINE = "baseline"  # the offloader stays out of the step: its time is the reference
TRIAL = "trial"  # offload a prefix of the plan and measure the step
REFERENCE = "reference"  # during the search: the offloader stays out, the step pairs with the next trial
RUN = "run"  # offload the settled plan; nothing measured, no host sync
IDLE = "idle"  # the settled plan is empty: the offloader stays out of the step

OUT_OF_STEP = (BASELINE, REFERENCE, IDLE)  # modes in which the offloader stays out of the step
TIMED_FORWARD = (PROFILE, BASELINE)  # steps that mark the end of the last decoder layer's forward

_TRIES = 8  # prefixes measured per shape before the search keeps what it has
_REFERENCE_STEPS = 3  # the reference is the median of these: one slow step must not let a plan pass
_SMALL, _SMALL_COPIES = 4096, 32  # the fixed cost of a copy is timed on this many copies of this size
# On a GPU, a measured step this much slower than the reference steps after it was a cold one (the first
# step of a process initialises libraries and grows the allocator inside its first layers; on the H100 a
# small GQA model's plan then chose 18 of 56 candidates instead of 42): its times per layer are not the
# step's, so it is measured again, at most this many times. (On the host backend the hooks of the measured
# step are a large part of a tiny model's step: no comparison there.)
_COLD, _REMEASURE = 1.5, 2


def shape_key(args: tuple, kwargs: dict) -> int | None:
    """Power-of-two bucket of the first decoder layer's input size (its hidden states)."""
    t = _scopes.layer_input(args, kwargs)
    return None if t is None else int(t.numel()).bit_length()


@dataclass
class StepTimes:
    """A step's marks on the copies' clock (events on a GPU; None where the step did not reach them) and the
    device's allocated bytes, as the offloader records them for the budget mode."""

    start: Any = None
    alloc_start: int = 0
    layers: dict[int, Any] = field(default_factory=dict)  # where each decoder layer's forward began
    layers_end: Any = None  # where the last decoder layer's forward ended
    backward_start: Any = None
    allocated_at_backward: int = 0


@dataclass(frozen=True)
class Measured:
    """What the budget mode reads of a step that just ended: its ``times``, the offloader's ``copies`` (the
    clock, the link-rate and copy-cost probes) and its host ``pool`` (reserved for the plan)."""

    times: StepTimes
    copies: Any
    pool: HostPool


def _step_s(m: Measured, end: Any = None) -> float:
    """Seconds from the step's start mark to ``end`` (now, if not given), after one host sync."""
    end = m.copies.mark() if end is None else end
    m.copies.synchronize()
    return m.copies.elapsed(m.times.start, end)


def forward_scale(
    profile: dict[str, Any], baseline_s: float, reference_forward: list[float]
) -> tuple[float, float]:
    """The factor that takes the measured step's forward-pass times to the reference steps', and the
    step's length to plan for.

    The measured step runs a Python call for every saved tensor of every layer, in the forward pass only:
    where the host barely keeps ahead of the GPU its forward pass stretches and its backward does not (on
    the H100, a small MoE's: 73 ms against 46 ms without the offloader, for the same backward). Scaled by
    the whole step, its forward pass would still look half as long again as it is, and the plan would count
    on the link for time that is not there. So the forward pass is scaled by the reference steps' own
    (to the end of the last decoder layer, where both mark it); without that mark, by the whole step.
    """
    step = profile["step_s"]
    if baseline_s <= 0 or step <= 0:
        return 1.0, step
    measured = profile.get("layers_end_s")
    if measured and reference_forward:
        return _budget.median(reference_forward) / measured, baseline_s
    return baseline_s / step, baseline_s


@dataclass
class _Shape:
    profile: dict[str, Any] | None = None  # the measured step's figures, waiting for the reference steps
    reference: list[float] = field(default_factory=list)
    reference_forward: list[float] = field(default_factory=list)  # to the last layer's end
    plan: _budget.OffloadPlan | None = None
    search: _budget.PrefixSearch | None = None
    remeasured: int = 0  # measured steps discarded as cold


class BudgetControl:
    """What each step of a budget-mode handle does, and what it learns from it."""

    def __init__(self, budget: str | int, max_overhead: float, lag: int) -> None:
        self.budget = budget
        self.max_overhead = max_overhead
        self.lag = lag
        self.shapes: dict[int | None, _Shape] = {}
        self.expect: int | None = None  # the shape of the last step: the next one is planned for it
        self.mode = RUN
        self.key: int | None = None  # this step's shape, once its first layer ran
        self.key_seen = False
        self._entered_for: int | None = None

    # ------------------------------------------------------------- per step
    def mode_for(self, key: int | None) -> str:
        s = self.shapes.get(key)
        if s is None or (s.profile is None and s.plan is None):
            return PROFILE
        if s.plan is None:
            return BASELINE
        if s.search is not None and not s.search.done:
            return REFERENCE if s.search.wants_reference else TRIAL
        return RUN if s.plan.chosen else IDLE

    def begin(self) -> str:
        self._entered_for = self.expect
        self.key = self.expect
        self.key_seen = False
        self.mode = self.mode_for(self.expect)
        return self.mode

    def first_layer(self, key: int | None, bypass: bool) -> bool:
        """The step's shape is known; returns whether the mode changed (the step's shape is not the one it
        was entered for). A step the offloader stays out of cannot start offloading: it runs as it is."""
        self.key = key
        self.key_seen = True
        if key == self._entered_for or bypass:
            return False
        mode = self.mode_for(key)
        self.mode = RUN if mode in OUT_OF_STEP else mode
        return True

    def selection(self) -> set[tuple[str, int]]:
        plan = self.current_plan(self.key)
        return set() if plan is None else {(c.name, c.layer) for c in plan.chosen}

    def current_plan(self, key: int | None) -> _budget.OffloadPlan | None:
        s = self.shapes.get(key)
        return None if s is None else s.plan

    @property
    def settled(self) -> bool:
        return self.mode_for(self.expect) in (RUN, IDLE)

    # --------------------------------------------------------------- learning
    def end(self, m: Measured, measured: dict[tuple[str, int], list[Any]] | None) -> None:
        """Learn from the step that just ended (one host sync when it was measured)."""
        mode, key = self.mode, self.key
        self.expect = key
        if mode == PROFILE:
            assert measured is not None
            self._profiled(m, key, measured)
        elif mode == BASELINE and key == self._entered_for:
            s = self.shapes[key]
            s.reference.append(_step_s(m))
            if m.times.layers_end is not None:
                s.reference_forward.append(m.copies.elapsed(m.times.start, m.times.layers_end))
            if len(s.reference) >= _REFERENCE_STEPS:
                baseline = _budget.median(s.reference)
                assert s.profile is not None
                cold = m.copies.asynchronous and s.profile["step_s"] > _COLD * baseline
                if cold and s.remeasured < _REMEASURE:
                    self.shapes[key] = _Shape(remeasured=s.remeasured + 1)  # measured again, warm
                else:
                    self._plan(m, key, baseline)
        elif mode == REFERENCE and key == self._entered_for:
            s = self.shapes[key]
            assert s.search is not None
            s.search.record_reference(_step_s(m))
        elif mode == TRIAL:
            s = self.shapes[key]
            assert s.search is not None
            s.plan = s.search.record(_step_s(m))

    def _profiled(self, m: Measured, key: int | None, measured: dict) -> None:
        times, copies, pool = m.times, m.copies, m.pool
        end = copies.mark()
        step_s = _step_s(m, end)  # the one host sync of the measured step: its events can be read now
        start = times.start
        cands = [
            _budget.Candidate(name, layer, nbytes, copies.elapsed(start, t0), count)
            for (name, layer), (nbytes, t0, count) in measured.items()
        ]
        total = sum(c.nbytes for c in cands)
        if copies.asynchronous:
            act = max(0, int(times.allocated_at_backward - times.alloc_start)) or total
        else:
            act = total
        probe = max(min(total, 512 << 20), 1 << 20)
        pool.reserve(probe)
        rate = copies.link_rate(pool.alloc(probe))
        pool.reset()
        pool.reserve(_SMALL * _SMALL_COPIES)
        per_copy = copies.copy_cost(pool.alloc(_SMALL * _SMALL_COPIES), _SMALL)
        pool.reset()
        layers_end = times.layers_end
        backward = times.backward_start
        profile = {
            "candidates": cands,
            "layers_end_s": None if layers_end is None else copies.elapsed(start, layers_end),
            "layer_starts": {i: copies.elapsed(start, t) for i, t in times.layers.items()},
            "forward_s": copies.elapsed(start, end if backward is None else backward),
            "step_s": step_s,
            "activation_bytes": act,
            "rate": rate,
            "per_copy_s": per_copy,
        }
        old = self.shapes.get(key)
        s = self.shapes[key] = _Shape(profile=profile, remeasured=0 if old is None else old.remeasured)
        if self.budget != "auto":  # a byte budget must be met, hidden or not: no reference, no search
            self._plan(m, key, 0.0)
            s.plan = replace(s.plan, settled=True)  # type: ignore[arg-type]

    def _plan(self, m: Measured, key: int | None, baseline_s: float) -> None:
        s = self.shapes[key]
        p = s.profile
        assert p is not None
        r, step_s = forward_scale(p, baseline_s, s.reference_forward)
        plan = _budget.choose(
            [replace(c, produced_s=c.produced_s * r) for c in p["candidates"]],
            layer_starts={i: t * r for i, t in p["layer_starts"].items()} or None,
            lag=self.lag,
            tail=self.lag,
            budget=self.budget if self.budget == "auto" else int(self.budget),
            d2h_bytes_per_s=p["rate"],
            forward_s=p["forward_s"] * r,
            step_s=step_s,
            activation_bytes=p["activation_bytes"],
            max_overhead=self.max_overhead,
            per_copy_s=p["per_copy_s"],
        )
        if s.remeasured:
            plan = replace(
                plan,
                reasons=(
                    *plan.reasons,
                    f"measured again {s.remeasured}x: the step measured took over {_COLD}x the steps "
                    "without offloading after it (a cold start), so its times per layer were not the step's",
                ),
            )
        s.profile = None
        if self.budget == "auto":
            s.search = _budget.PrefixSearch(plan, baseline_s, self.max_overhead, tries=_TRIES)
            plan = s.search.plan
        s.plan = plan
        if plan.offload_bytes:
            m.pool.reserve(plan.offload_bytes + (64 << 20))
