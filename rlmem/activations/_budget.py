"""Choosing what to offload from a measured warm-up step (the budget mode of ``offload_activations``).

Activations leave the device during the forward pass, one copy after another on one link. A copy can
start once its tensor is produced and must end before the forward pass (plus the overhead accepted) ends,
or the step waits for it. So the choice is a queue: candidates are taken in the order they are produced
(earliest layers first: they have the most compute left to hide under, and backward needs them last),
and each is kept only if the queue still drains in time. A byte budget adds what is needed to get under
it, hidden or not, and says what that costs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .._results import Result
from .._units import GiB
from .modmap import SHARED_INPUT


@dataclass(frozen=True)
class Candidate:
    """Bytes that one (name, layer) scope saved in the measured step, and when (seconds from step start)."""

    name: str
    layer: int
    nbytes: int
    produced_s: float
    count: int = 1  # tensors: each copy has a fixed cost besides its bytes


@dataclass(frozen=True)
class OffloadPlan(Result):
    """What the budget mode chose, and why. ``str(plan)`` is a short report."""

    budget: str
    chosen: tuple[Candidate, ...]
    candidates: tuple[Candidate, ...]
    d2h_bytes_per_s: float
    forward_s: float
    step_s: float
    activation_bytes: int
    allowance_s: float
    finish_s: float
    stall_s: float = 0.0
    reasons: tuple[str, ...] = ()
    # budget="auto" closes the loop: the same step without offloading (``baseline_s``), then steps run
    # with a prefix of the plan, each ``(candidates offloaded, measured overhead)`` in ``trials``.
    baseline_s: float = 0.0
    trials: tuple[tuple[int, float], ...] = ()
    settled: bool = False

    @property
    def offload_bytes(self) -> int:
        return sum(c.nbytes for c in self.chosen)

    @property
    def link_bound_bytes(self) -> int:
        """Bytes the link can move while the forward pass (plus the allowance) runs."""
        return int(self.d2h_bytes_per_s * (self.forward_s + self.allowance_s))

    @property
    def expected_overhead_s(self) -> float:
        """Seconds the compute is expected to wait for copies (0 when everything hides)."""
        return self.stall_s

    @property
    def measured_overhead(self) -> tuple[float, ...]:
        """Each measured step's time over the unoffloaded step's, minus 1, in the order they ran."""
        return tuple(m for _, m in self.trials)

    @property
    def shrunk(self) -> int:
        """How many measured steps added more than the allowed overhead (and so shrank the plan)."""
        return sum(1 for m in self.measured_overhead if m > self.allowed_overhead)

    @property
    def allowed_overhead(self) -> float:
        return self.allowance_s / self.step_s if self.step_s > 0 else 0.0

    def selection(self) -> dict[str, list[int]]:
        """Chosen layers per name."""
        out: dict[str, list[int]] = {}
        for c in self.chosen:
            out.setdefault(c.name, []).append(c.layer)
        return {k: sorted(v) for k, v in out.items()}

    def __str__(self) -> str:
        gib = GiB
        lines = [
            f"rlmem activation offload plan (budget={self.budget})",
            f"  warm-up step {self.step_s * 1e3:.1f} ms, forward {self.forward_s * 1e3:.1f} ms, "
            f"activations {self.activation_bytes / gib:.3f} GiB, "
            f"link D2H {self.d2h_bytes_per_s / 1e9:.1f} GB/s",
            f"  the link can hide {self.link_bound_bytes / gib:.3f} GiB "
            f"(forward + {self.allowance_s * 1e3:.1f} ms allowed); chosen {self.offload_bytes / gib:.3f} GiB "
            f"of {sum(c.nbytes for c in self.candidates) / gib:.3f} GiB offloadable, expected wait "
            f"{self.expected_overhead_s * 1e3:.1f} ms",
        ]
        if self.baseline_s:
            lines.append(f"  the step without offloading: {self.baseline_s * 1e3:.1f} ms")
        if self.trials:
            lines.append(
                "  measured overhead (candidates offloaded: added to the step): "
                + ", ".join(f"{k}: {m:+.1%}" for k, m in self.trials)
                + (f" (shrunk {self.shrunk}x)" if self.shrunk else "")
                + ("; settled" if self.settled else "; still measuring")
            )
        for name, layers in self.selection().items():
            lines.append(f"  {name}: layers {_ranges(layers)}")
        lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)


def _ranges(xs: list[int]) -> str:
    out, start, prev = [], None, None
    for x in [*xs, None]:  # type: ignore[list-item]
        if start is None:
            start = prev = x
        elif x is not None and x == prev + 1:
            prev = x
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = x
    return ",".join(out) if xs else "none"


def _allowed(c: Candidate, chosen: list[Candidate]) -> bool:
    need = SHARED_INPUT.get(c.name)
    return need is None or any(x.name == need and x.layer == c.layer for x in chosen)


def _drain(items: list[Candidate], rate: float) -> float:
    t = 0.0
    for c in sorted(items, key=lambda c: c.produced_s):
        t = max(t, c.produced_s) + c.nbytes / rate
    return t


def _stall(items: list[Candidate], rate: float, layer_starts: dict[int, float], lag: int) -> float:
    """Seconds the compute waits in total: at the start of layer j it waits for the copies of layers
    <= j - lag (how the offloader frees them). A wait delays everything produced after it."""
    events = [(t, 0, j, None) for j, t in layer_starts.items()]
    events += [(c.produced_s, 1, c.layer, c) for c in items]
    shift = link = 0.0
    done: dict[int, float] = {}
    for t, _kind, j, c in sorted(events, key=lambda e: (e[0], e[1])):
        if c is None:
            need = max((v for g, v in done.items() if g <= j - lag), default=0.0)
            shift += max(0.0, need - (t + shift))
        else:
            link = max(link, t + shift) + c.nbytes / rate
            done[j] = max(done.get(j, 0.0), link)
    return shift


def _backward_stall(
    items: list[Candidate], rate: float, layers: list[int], backward_s: float, prefetch: int = 1
) -> float:
    """Seconds the backward pass waits for reloads. It runs the layers in reverse, ``backward_s`` spread
    evenly over them; layer j's tensors are reloaded (one link, in order) from when the backward of layer
    ``j + prefetch`` starts (the last layers' from when backward starts), and layer j's backward starts once
    they are in. The last layers have the least time to get theirs back."""
    if not items or not layers:
        return 0.0
    per = backward_s / len(layers)
    nbytes: dict[int, int] = {}
    for c in items:
        nbytes[c.layer] = nbytes.get(c.layer, 0) + c.nbytes
    order = sorted(layers, reverse=True)
    starts: list[float] = []
    t = link = stall = 0.0
    for k, j in enumerate(order):
        ready = 0.0
        if nbytes.get(j):
            issue = starts[k - prefetch] if k >= prefetch else 0.0
            link = max(link, issue) + nbytes[j] / rate
            ready = link
        start = max(t, ready)
        stall += start - t
        starts.append(start)
        t = start + per
    return stall


def choose(
    candidates: list[Candidate],
    *,
    budget: str | int,
    d2h_bytes_per_s: float,
    forward_s: float,
    step_s: float,
    activation_bytes: int,
    max_overhead: float,
    layer_starts: dict[int, float] | None = None,
    lag: int = 2,
    tail: int = 0,
    h2d_bytes_per_s: float | None = None,
    per_copy_s: float = 0.0,
) -> OffloadPlan:
    """Pick candidates so that copies hide under the forward pass (``budget="auto"``), or so that at most
    ``budget`` bytes of activations stay on the device, hiding as much as possible.

    A candidate hides if the copy queue still drains by the end of the forward pass plus the allowance
    (a copy ending later does not lower the peak) and the compute's waits for copies, ``lag`` layers
    behind (``layer_starts``: seconds from step start per layer; derived from the candidates if absent),
    stay within the allowance, together with the backward pass's waits for the reloads
    (:func:`_backward_stall`; ``h2d_bytes_per_s`` defaults to the D2H rate). Each tensor's copy costs
    ``per_copy_s`` besides its bytes (issuing it and its hooks), so many small tensors cost more than their
    bytes say. The last ``tail`` layers' candidates are left out: the offloader frees a layer's copies
    ``lag`` layers later, so theirs would still be on the device when backward starts (and be used from
    there): offloading them lowers nothing.
    """
    assert d2h_bytes_per_s > 0 and forward_s >= 0
    allowance = max_overhead * step_s
    deadline = forward_s + allowance
    if layer_starts is None:
        layer_starts = {}
        for c in candidates:
            layer_starts[c.layer] = min(layer_starts.get(c.layer, c.produced_s), c.produced_s)
    last = max(layer_starts, default=-1)
    order = sorted(
        (c for c in candidates if c.layer <= last - tail), key=lambda c: (c.layer, c.produced_s, -c.nbytes)
    )
    left = len(candidates) - len(order)
    # The fixed cost per copy, as the bytes the link would move in that time.
    timed = {c: replace(c, nbytes=c.nbytes + round(c.count * per_copy_s * d2h_bytes_per_s)) for c in order}
    h2d = h2d_bytes_per_s or d2h_bytes_per_s
    layers = sorted(layer_starts)
    backward_s = max(step_s - forward_s, 0.0)

    def waits(items: list[Candidate]) -> float:
        items = [timed[c] for c in items]
        fwd = _stall(items, d2h_bytes_per_s, layer_starts, lag)
        return fwd + _backward_stall(items, h2d, layers, backward_s)

    def drain(items: list[Candidate]) -> float:
        return _drain([timed[c] for c in items], d2h_bytes_per_s)

    chosen: list[Candidate] = []
    reasons: list[str] = []
    late = stalled = 0
    for c in order:
        trial = [*chosen, c]
        if not _allowed(c, chosen):
            continue
        if drain(trial) > deadline:
            late += 1
        elif waits(trial) > allowance + 1e-6:  # a microsecond: below what the measurements resolve
            stalled += 1
        else:
            chosen.append(c)
    if late:
        reasons.append(
            f"{late} of {len(order)} candidates left on the device: their copies would end after the "
            "forward pass plus the allowed overhead"
        )
    if stalled:
        reasons.append(
            f"{stalled} of {len(order)} candidates left on the device: the compute would wait more than the "
            f"allowed overhead for copies {lag} layers behind, or the backward pass for their reloads"
        )
    if left:
        reasons.append(
            f"{left} candidates of the last {tail} layers left on the device: the forward pass ends before "
            "their memory would be freed, and backward needs them first"
        )
    if not late and not stalled:
        reasons.append(f"every {'other ' if left else ''}candidate's copy hides under the forward pass")
    if budget != "auto":
        assert isinstance(budget, int)
        need = activation_bytes - budget
        have = sum(c.nbytes for c in chosen)
        if need > have:
            for c in order:
                if have >= need:
                    break
                if c not in chosen and _allowed(c, chosen):
                    chosen.append(c)
                    have += c.nbytes
            reasons.append(
                f"budget {budget / GiB:.3f} GiB needs {max(need, 0) / GiB:.3f} GiB off the device; "
                f"added candidates that do not hide"
            )
            if have < need:
                reasons.append(
                    f"offloading every candidate still leaves {(need - have) / GiB:.3f} GiB over the "
                    "budget: checkpoint layers (rlmem.checkpoint) to get under it"
                )
        else:
            kept, have = [], 0
            for c in chosen:
                if have >= need:
                    break
                kept.append(c)
                have += c.nbytes
            chosen = kept
            reasons.append(
                f"budget {budget / GiB:.3f} GiB met by {have / GiB:.3f} GiB of copies that hide; "
                "nothing more is offloaded"
            )
    finish = drain(chosen) if chosen else 0.0
    stall = waits(chosen) if chosen else 0.0
    return OffloadPlan(
        budget=str(budget),
        chosen=tuple(chosen),
        candidates=tuple(candidates),
        d2h_bytes_per_s=d2h_bytes_per_s,
        forward_s=forward_s,
        step_s=step_s,
        activation_bytes=activation_bytes,
        allowance_s=allowance,
        finish_s=finish,
        stall_s=stall,
        reasons=tuple(reasons),
    )


def balanced(chosen: tuple[Candidate, ...]) -> tuple[Candidate, ...]:
    """``chosen`` reordered so that every prefix spreads over the layers: each layer's first candidate
    (in the order produced), then each layer's second, and so on. A layer's copies then keep pace with its
    compute; a prefix of whole early layers would queue copies faster than the layers produce time."""
    by_layer: dict[int, list[Candidate]] = {}
    for c in sorted(chosen, key=lambda c: (c.layer, c.produced_s)):
        by_layer.setdefault(c.layer, []).append(c)
    out: list[Candidate] = []
    rank = 0
    while len(out) < len(chosen):
        out += [cs[rank] for _, cs in sorted(by_layer.items()) if rank < len(cs)]
        rank += 1
    return tuple(out)


SMALL_SHARE, SMALL_LIMIT = 0.1, 0.02  # a prefix offloading under this share of the activations: this limit


class PrefixSearch:
    """The closed loop of ``budget="auto"``: the longest prefix of a plan's candidates (in the order of
    :func:`balanced`) whose measured step stays within ``limit`` over the unoffloaded one, by bisection.

    A prefix that offloads less than :data:`SMALL_SHARE` of the step's activation bytes may add no more than
    :data:`SMALL_LIMIT` (or ``limit``, if lower). The whole plan is measured first; while a prefix adds too
    much, the search halves towards the longest one measured within the limit, and stops when the gap is
    under 1/16 of the plan or after ``tries`` prefixes, keeping the longest prefix measured within the limit
    (none, if none was).

    Each step of a prefix is paired with a step without offloading just before it (:attr:`wants_reference`,
    :meth:`record_reference`; without them the reference given at the start stands in) and the prefix
    counts by the median of the pairs' ratios: a step time that drifts over the run (clocks, a host that
    does other work) moves both halves of a pair, and the first step of a new plan, which pays once for
    what it allocates, is outvoted. A prefix runs ``repeats`` pairs, and up to ``max_repeats`` while the
    ratios spread over more than twice the limit (a step that syncs the host often, such as an MoE's
    expert loop, varies by tens of percent): the user's steps are judged by their typical time.

    The prefix kept is then checked as it will run, ``repeats`` steps in a row with no step between them
    (against the median of the reference steps): offloading steps that follow each other can cost more
    than one between two that do not. If it adds too much, the search goes on below it (checks are not
    counted in ``tries``: each one that fails drops a prefix, and a plan settles only once checked).
    """

    def __init__(
        self,
        plan: OffloadPlan,
        baseline_s: float,
        limit: float,
        *,
        tries: int = 8,
        repeats: int = 3,
        max_repeats: int = 6,
    ) -> None:
        assert baseline_s > 0 and tries >= 1 and 1 <= repeats <= max_repeats
        self._repeats, self._max_repeats = repeats, max_repeats
        self._seen: list[float] = []  # this prefix's steps
        self._refs: list[float] = []  # the step without offloading before each of them
        self._all_refs: list[float] = [baseline_s]  # every reference step: the in-a-row check's reference
        self._good: list[int] = []  # prefixes measured within the limit (in pairs)
        self._full = balanced(plan.chosen)
        # What a prefix may add: ``limit``, and no more than SMALL_LIMIT where it offloads under SMALL_SHARE
        # of the step's activation bytes (a small saving is not worth much of the step).
        small = min(limit, SMALL_LIMIT)
        total, self._limits = 0, [small if plan.activation_bytes else limit]
        for c in self._full:
            total += c.nbytes
            self._limits.append(small if total < SMALL_SHARE * plan.activation_bytes else limit)
        self._tries = tries
        self._lo, self._hi = 0, len(self._full) + 1  # longest prefix measured good, shortest measured bad
        self._step = max(1, len(self._full) // 16)
        self.k = len(self._full)  # the prefix the next step runs with
        self.checking = False  # the kept prefix runs steps in a row
        self._checks = 0  # in-a-row checks so far: not counted in ``tries`` (each failed one drops a prefix)
        self.plan = replace(plan, baseline_s=baseline_s, settled=not self._full)
        self._baseline = baseline_s

    @property
    def done(self) -> bool:
        return self.plan.settled

    @property
    def wants_reference(self) -> bool:
        """Whether the next step should run without offloading (the first half of a pair)."""
        return not self.done and not self.checking and len(self._refs) <= len(self._seen)

    def record_reference(self, step_s: float) -> None:
        """Record a step that ran without offloading, paired with the next step of the prefix."""
        assert self.wants_reference
        self._refs.append(step_s)
        self._all_refs.append(step_s)

    def _ratios(self) -> list[float]:
        if self.checking:
            ref = median(self._all_refs)
            return sorted(t / ref for t in self._seen)
        refs = [r if r > 0 else self._baseline for r in self._refs]
        refs += [self._baseline] * (len(self._seen) - len(refs))  # unpaired: the reference of the start
        return sorted(t / r for t, r in zip(self._seen, refs, strict=False))

    def record(self, step_s: float) -> OffloadPlan:
        """Record a step that ran with the current prefix; returns the plan to run next."""
        assert not self.done
        self._seen.append(step_s)
        ratios = self._ratios()
        n = len(ratios)
        limit = self._limits[self.k]
        if n < self._repeats or (n < self._max_repeats and ratios[-1] - ratios[0] > 2 * limit):
            return self.plan
        over = median(ratios) - 1
        self._seen, self._refs = [], []
        trials = (*self.plan.trials, (self.k, over))
        reasons = list(self.plan.reasons)
        checked = self.checking
        self.checking = False
        self._checks += checked
        if over <= limit:
            if checked:  # the kept prefix holds in a row too
                return self._settle(trials, reasons, checked=True)
            self._lo = self.k
            self._good.append(self.k)
        else:
            self._hi = self.k
            self._good = [g for g in self._good if g < self.k]
            self._lo = max(self._good, default=0)
            how = " in a row" if checked else ""
            reasons.append(
                f"{self.k} candidates added {over:.1%} to the step{how}, over the allowed {limit:.1%}"
            )
        searched = len(trials) - self._checks >= self._tries
        if self._hi - self._lo <= self._step or searched:
            if self._lo > 0:
                self.k, self.checking = self._lo, True  # check the prefix kept, steps in a row
                self.plan = replace(
                    self.plan, chosen=self._full[: self.k], trials=trials, reasons=tuple(reasons)
                )
                return self.plan
            return self._settle(trials, reasons, checked=False)
        self.k = (self._lo + self._hi) // 2
        self.plan = replace(self.plan, chosen=self._full[: self.k], trials=trials, reasons=tuple(reasons))
        return self.plan

    def _settle(self, trials: tuple, reasons: list[str], *, checked: bool) -> OffloadPlan:
        assert checked or self._lo == 0
        self.k = self._lo
        if self._lo == 0:
            reasons.append("nothing is offloaded: every plan measured added more than allowed")
        elif self._lo < len(self._full):
            reasons.append(f"kept the first {self._lo} of {len(self._full)} candidates")
        self.plan = replace(
            self.plan, chosen=self._full[: self.k], trials=trials, settled=True, reasons=tuple(reasons)
        )
        return self.plan


def median(xs: list[float]) -> float:
    """The median (the mean of the two middle values of an even count)."""
    xs = sorted(xs)
    n = len(xs)
    return (xs[(n - 1) // 2] + xs[n // 2]) / 2
