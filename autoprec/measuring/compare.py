"""Timing as paired, interleaved comparisons that run until the ratio is decided.

Every latency decision the tuner takes ("is bf16 faster than fp32 here", "is this policy faster
than that one") is a question about a *ratio* of two times taken on a machine whose speed changes
under our feet: other processes, frequency scaling, a neighbour's burst. :func:`compare` answers
it the way a careful person would:

- every entry is warmed up until its time settles, then the entries run once per *round*;
  each round's order is the previous one reversed or rotated (A B, B A, B A, A B, ...), so no
  entry always runs first or always follows the same neighbour, and a linear drift inside a
  pair of rounds hits every entry alike;
- the statistic is the per-round log-ratio of an entry's time to the reference's time, taken in
  the same time window, so a slow phase that hits a whole round cancels;
- its Hodges-Lehmann estimate and Wilcoxon signed-rank interval (order statistics of the
  pairwise means: no normality, and a 2x burst in a few rounds moves neither) are recomputed
  after each round;
- rounds go on until every entry's interval either excludes 1 (faster or slower) or lies within
  ``rel_precision`` of its estimate (a tie at that precision), or until a round or time cap;
  then the :class:`Comparison` says which entries are undecided and how noisy the machine was.

Checking the interval after every round is sequential testing: each look is another chance of a
false "faster", so that decision takes a stricter confidence (see :func:`_looked_at`).
The clock and the callables are injected, so the statistics are unit-tested on fake machines.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
import itertools
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

__all__ = ["TIE_TOLERANCE", "Comparison", "Interval", "Ratio", "compare", "median_interval", "paired_ratio",
           "rotations", "round_orders", "settle", "shift_interval", "timed_together", "together"]

# Processes that run one job (the ranks of a torchrun job) time it together: every call to a model with
# collectives inside must happen on all of them, so each round's times become the slowest process's (the
# job's round takes that long) and every decision to go on or stop is taken on those, the same everywhere.
_SLOWEST: contextvars.ContextVar[Callable[[list[float]], list[float]] | None] = contextvars.ContextVar(
    "slowest", default=None)


@contextlib.contextmanager
def timed_together(slowest: Callable[[list[float]], list[float]]) -> Iterator[None]:
    """Within this block, :func:`compare` takes its figures through ``slowest`` (values -> each one's largest
    over the processes timing together), so that all of them run the same calls in the same order."""
    token = _SLOWEST.set(slowest)
    try:
        yield
    finally:
        _SLOWEST.reset(token)


def together(values: list[float]) -> list[float]:
    """``values`` as the processes timing together see them (see :func:`timed_together`): each one's largest."""
    slowest = _SLOWEST.get()
    return values if slowest is None else slowest(values)

# An estimate this close to 1 is no difference on a shared machine: a ratio that only all the rounds at once put
# on one side of 1 must also be further than this from it (:attr:`Ratio.outcome`)
TIE_TOLERANCE = 0.03

_MAD_TO_SIGMA = 1.4826  # median absolute deviation of a normal sample, in standard deviations


def _binom_cdf(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def _order_statistic_k(cdf: Callable[[int], float], limit: int, confidence: float) -> int:
    """The number of order statistics to cut from each end: the largest k <= limit with
    2 P(statistic <= k - 1) <= 1 - confidence (0: too few values for that confidence)."""
    k = 0
    while k + 1 <= limit and 2 * cdf(k) <= 1 - confidence:
        k += 1
    return k


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(median, low, high) of ``values`` with a distribution-free interval for the median.

    The interval is the pair of order statistics of the sign test: with ``n`` values, the k-th
    smallest and k-th largest, for the largest k whose coverage is at least ``confidence``.
    Too few values for that coverage (n < 6 at 95%) give (-inf, inf): undecidable, honestly.
    """
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("median_interval needs at least one value")
    k = _order_statistic_k(lambda j: _binom_cdf(j, n), n // 2, confidence)
    if k == 0:
        return statistics.median(xs), -math.inf, math.inf
    return statistics.median(xs), xs[k - 1], xs[n - k]


_EXACT_UP_TO = 60  # rounds for which the signed-rank distribution is counted exactly


@functools.cache
def _signed_rank_counts(n: int) -> tuple[int, ...]:
    """How many sign patterns of ranks 1..n give each signed-rank sum T = 0..n(n+1)/2."""
    if n == 0:
        return (1,)
    counts = list(_signed_rank_counts(n - 1)) + [0] * n  # times (1 + x^n)
    for t, c in enumerate(_signed_rank_counts(n - 1)):
        counts[t + n] += c
    return tuple(counts)


def _signed_rank_cdf(n: int) -> Callable[[int], float]:
    """t -> P(T <= t), T the Wilcoxon signed-rank statistic of n values: exact up to
    ``_EXACT_UP_TO`` values, the normal approximation (continuity-corrected) beyond."""
    if n > _EXACT_UP_TO:
        mean, sd = n * (n + 1) / 4, math.sqrt(n * (n + 1) * (2 * n + 1) / 24)
        return lambda t: 0.5 * math.erfc(-(t + 0.5 - mean) / (sd * math.sqrt(2)))
    cumulative = list(itertools.accumulate(_signed_rank_counts(n)))
    return lambda t: cumulative[t] / 2**n


def shift_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(estimate, low, high): the Hodges-Lehmann estimate of the centre of ``values`` (median of
    the pairwise means) with the Wilcoxon signed-rank interval.

    For paired log-ratios, whose noise is symmetric when both entries suffer alike, it needs
    about 1.5x fewer rounds than the median's sign-test interval for the same width, and a
    burst in up to ~29% of the rounds moves it little. Fewer than 6 values give (-inf, inf) at 95%.
    """
    return _shift_intervals(values, (confidence,))[0]


def _shift_intervals(values: Sequence[float], confidences: Sequence[float]) -> list[tuple[float, float, float]]:
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("shift_interval needs at least one value")
    walsh = sorted((xs[i] + xs[j]) / 2 for i in range(n) for j in range(i, n))
    centre, cdf, out = statistics.median(walsh), _signed_rank_cdf(n), []
    for confidence in confidences:
        k = _order_statistic_k(cdf, len(walsh) // 2, confidence)
        out.append((centre, walsh[k - 1], walsh[len(walsh) - k]) if k else (centre, -math.inf, math.inf))
    return out


def _looked_at(confidence: float) -> float:
    """The confidence a "faster"/"slower" decision needs when the interval is checked after every
    round: 1 - (1 - confidence) / 5 (99% for 95%), a Pocock-style correction that keeps the
    chance of a false decision over a whole :func:`compare` run near 1 - confidence (tested on
    fake machines); ties need only the stated confidence, a false tie being within precision."""
    return 1 - (1 - confidence) / 5


@dataclass(frozen=True)
class Interval:
    """A time (ms) with its confidence interval. Intervals add (``sum(parts)``) in quadrature,
    which assumes independent errors: for the additive latency model, per-layer costs."""

    estimate: float
    low: float
    high: float

    def __add__(self, other: Interval) -> Interval:
        lo = math.hypot(self.estimate - self.low, other.estimate - other.low)
        hi = math.hypot(self.high - self.estimate, other.high - other.estimate)
        total = self.estimate + other.estimate
        return Interval(total, total - lo, total + hi)

    def __radd__(self, other: Any) -> Interval:
        if other == 0:  # sum() starts from 0
            return self
        return NotImplemented

    def __str__(self) -> str:
        return f"{self.estimate:.3g} ms [{self.low:.3g}, {self.high:.3g}]"


@dataclass(frozen=True)
class Ratio:
    """An entry's time over another's, from per-round ratios: the Hodges-Lehmann estimate with
    its Wilcoxon interval (:func:`shift_interval` of the log-ratios).

    The decision is "faster"/"slower" when an interval at the stricter confidence of
    :func:`_looked_at` excludes 1 (the interval is looked at after every round, and each look is
    a chance of a false "faster"), or when the interval is within ±``rel_precision`` and both it
    and the estimate are further than that from 1; else "tie" when the interval is within
    ±``rel_precision`` (a difference smaller than the precision counts as none), else "undecided"."""

    estimate: float
    low: float
    high: float
    rounds: int
    decision: str  # "faster", "slower", "tie" (within the precision) or "undecided"

    @property
    def decided(self) -> bool:
        return self.decision != "undecided"

    @property
    def faster(self) -> bool:
        return self.decision == "faster"

    @property
    def slower(self) -> bool:
        return self.decision == "slower"

    @property
    def tie(self) -> bool:
        """Neither faster nor slower: decided as equal within the precision, or undecided."""
        return not (self.faster or self.slower)

    @classmethod
    def of(cls, times: Sequence[float], reference: Sequence[float], confidence: float = 0.95,
           rel_precision: float = 0.03) -> Ratio:
        """From per-round times of an entry and of the reference (same rounds, same order)."""
        logs = [math.log(t / r) for t, r in zip(times, reference, strict=True)]
        (centre, low, high), (_, sure_low, sure_high) = _shift_intervals(logs, (confidence, _looked_at(confidence)))
        precise = (high - low) / 2 <= math.log1p(rel_precision)  # the interval is within ±rel_precision
        beyond = abs(centre) > math.log1p(rel_precision)  # a difference larger than the precision
        if sure_high < 0 or (precise and beyond and high < 0):
            decision = "faster"
        elif sure_low > 0 or (precise and beyond and low > 0):
            decision = "slower"
        else:
            decision = "tie" if precise else "undecided"
        return cls(math.exp(centre), math.exp(low), math.exp(high), len(logs), decision)

    @property
    def outcome(self) -> str:
        """What the rounds showed once they stopped: the one rule every choice, headline and note follows.

        "faster" or "slower" where the sequential test decided so while the rounds ran, or, where they ran to a
        cap undecided, where all of them at once do: the whole 95% interval on one side of 1 and the estimate
        more than :data:`TIE_TOLERANCE` from it (:attr:`by_all_rounds` says which); else the decision, "tie" or
        "undecided" (neither faster nor slower: a tie with the reference keeps the reference)."""
        if self.decision in ("faster", "slower"):
            return self.decision
        if self.high < 1 and self.estimate < 1 - TIE_TOLERANCE:
            return "faster"
        if self.low > 1 and self.estimate > 1 + TIE_TOLERANCE:
            return "slower"
        return self.decision

    @property
    def by_all_rounds(self) -> bool:
        """Decided faster or slower only by all the rounds at once, after they ran to a cap undecided."""
        return self.outcome != self.decision

    def words(self, reference: str = "fp32") -> str:
        """This ratio as a time against ``reference``'s, with what it decides (:attr:`outcome`)."""
        how = {"faster": "decided faster", "slower": "decided slower", "tie": f"a tie within ±{TIE_TOLERANCE:.0%}",
               "undecided": f"undecided: not distinguishable from {reference} at this noise"}[self.outcome]
        how += " by all the rounds at once, at the cap" if self.by_all_rounds else ""
        return (f"{self.estimate:.2f}x [{self.low:.2f}, {self.high:.2f}] of {reference}'s time over {self.rounds} "
                f"paired rounds, {how}")

    def at_most(self, limit: float) -> bool | None:
        """A goal "this ratio <= ``limit``" judged by the interval: True when all of it is at or below the
        limit, False when all of it is above, None (undecided at this noise) when it straddles the limit."""
        if self.high <= limit:
            return True
        return False if self.low > limit else None

    def within(self, rel_precision: float) -> bool:
        """Whether the interval is within ±``rel_precision`` of the estimate."""
        return self.low > 0 and math.sqrt(self.high / self.low) <= 1 + rel_precision

    def __str__(self) -> str:
        return f"{self.estimate:.2f}x [{self.low:.2f}, {self.high:.2f}] over {self.rounds} rounds"


@dataclass
class Comparison:
    """The result of :func:`compare`: samples, ratios to the reference, and how decided it is."""

    reference: str
    samples: dict[str, list[float]]  # ms per round, every entry in every round
    ratios: dict[str, Ratio]  # every other entry vs the reference
    rounds: int
    seconds: float
    confidence: float
    rel_precision: float
    capped_by: str | None = None  # "rounds" or "seconds" when a cap ended it before all were done
    caps: dict[str, float] = field(default_factory=dict)  # "rounds", "seconds"
    until: str = "decided"  # what "done" meant: every ratio decided, or every interval precise

    def ratio(self, entry: str, baseline: str) -> Ratio:
        """``entry``'s time over ``baseline``'s, paired round by round."""
        for name in (entry, baseline):
            if name not in self.samples:
                raise KeyError(f"no entry {name!r} in this comparison; entries: {', '.join(self.samples)}")
        return Ratio.of(self.samples[entry], self.samples[baseline], self.confidence, self.rel_precision)

    def ms(self, entry: str) -> Interval:
        """Median ms of ``entry`` over the rounds, with its distribution-free interval."""
        return Interval(*median_interval(self.samples[entry], self.confidence))

    @property
    def undecided(self) -> list[str]:
        """The entries not done: undecided, or (``until="precise"``) measured less precisely than asked."""
        if self.until == "precise":
            return [name for name, r in self.ratios.items() if not r.within(self.rel_precision)]
        return [name for name, r in self.ratios.items() if r.outcome == "undecided"]

    @property
    def decided(self) -> bool:
        return not self.undecided

    @property
    def noise(self) -> float:
        """Round-to-round timing noise as a relative figure (0.05 = ±5%): the robust spread
        (MAD, as a standard deviation) of the per-round log-ratios, the median over entries;
        with the reference alone, the spread of its own log-times."""
        def spread(xs: list[float]) -> float:
            mid = statistics.median(xs)
            return _MAD_TO_SIGMA * statistics.median(abs(x - mid) for x in xs)

        ref = self.samples[self.reference]
        if not self.ratios:
            return math.expm1(spread([math.log(t) for t in ref]))
        spreads = [spread([math.log(t / r) for t, r in zip(self.samples[n], ref)]) for n in self.ratios]
        return math.expm1(statistics.median(spreads))

    @property
    def verdict(self) -> str:
        """One line: what was decided, or that the machine was too noisy to decide within the cap."""
        n = len(self.ratios)
        noise = f"timing noise ±{self.noise:.0%}"
        if self.decided and self.capped_by is None:
            return f"{noise}: all {n} comparisons decided in {self.rounds} rounds ({self.seconds:.1f} s)"
        cap = (f"cap {self.caps['seconds']:g} s" if self.capped_by == "seconds"
               else f"cap {int(self.caps['rounds'])} rounds")
        if self.until == "precise":
            return (f"{noise} on this machine: {len(self.undecided)} of {n} ratios not measured to "
                    f"±{self.rel_precision * 100:g}% after {self.rounds} rounds ({cap}); see their intervals")
        late = [name for name, r in self.ratios.items() if r.by_all_rounds]
        late_said = (f"; {len(late)} decided only by all the rounds at once ({', '.join(late)}: the 95% interval "
                     f"on one side of 1, the estimate over {TIE_TOLERANCE:.0%} from it)" if late else "")
        if not self.undecided:
            return f"{noise} on this machine: all {n} comparisons decided after {self.rounds} rounds ({cap}){late_said}"
        return (f"{noise} on this machine: {len(self.undecided)} of {n} comparisons undecided after "
                f"{self.rounds} rounds ({cap}); not distinguishable from {self.reference}, treated as ties{late_said}")

    def to_dict(self) -> dict[str, Any]:
        """For profile.json and reports (non-finite bounds become null through jsonsafe)."""
        return {"reference": self.reference, "rounds": self.rounds, "seconds": self.seconds,
                "confidence": self.confidence, "rel_precision": self.rel_precision, "noise": self.noise,
                "decided": self.decided, "verdict": self.verdict, "samples_ms": self.samples,
                "ratios": {k: {**asdict(v), "outcome": v.outcome} for k, v in self.ratios.items()}}


def paired_ratio(samples: Mapping[str, Sequence[float]], key: str, over: str) -> Ratio | None:
    """``key``'s time over ``over``'s from their paired rounds (None when a run broke down or there
    is one estimate each: nothing to pair)."""
    a, b = samples[key], samples[over]
    if len(a) < 2 or len(a) != len(b) or not all(math.isfinite(x) and x > 0 for x in [*a, *b]):
        return None
    return Ratio.of(a, b)


def round_orders(keys: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of each round: odd rounds reverse the previous one, even rounds rotate the
    base order by one more step (A B C, C B A, B C A, A C B, C A B, B A C, ...)."""
    return [_order(keys, r) for r in range(rounds)]


def rotations(keys: Sequence[str], rounds: int) -> Iterator[tuple[int, str]]:
    """``(round, key)`` for every key in every round, in :func:`round_orders`' order: for loops that time
    each entry themselves (hooked runs, training steps) rather than through :func:`compare`."""
    if not keys:
        return
    for r in range(rounds):
        for key in _order(keys, r):
            yield r, key


def _order(keys: Sequence[str], r: int) -> list[str]:
    shift = (r // 2) % len(keys)
    order = list(keys[shift:]) + list(keys[:shift])
    return order[::-1] if r % 2 else order


def _default_sync(device: str) -> Callable[[], None]:
    if not str(device).startswith("cuda"):
        return lambda: None
    import torch

    return lambda: torch.cuda.synchronize(device)


def compare(runs: Mapping[str, Callable[[], Any]], *, reference: str, device: str = "cpu", min_rounds: int = 6,
            max_rounds: int = 60, max_seconds: float = 20.0, rel_precision: float = 0.03,
            confidence: float = 0.95, warmup: bool = True, clock: Callable[[], float] = time.perf_counter,
            sync: Callable[[], None] | None = None, until: str = "decided",
            switch: Callable[[str], None] | None = None) -> Comparison:
    """Time ``runs`` against ``runs[reference]`` until every ratio is decided or a cap is hit.

    ``until="precise"`` goes on until every interval is within ±``rel_precision`` instead: for
    figures that are used as magnitudes (per-layer costs, a benchmark's ratios between entries),
    not only as a direction.

    ``min_rounds`` always run (6 is the fewest that can decide anything at 95%); after that a
    new round starts only while fewer than ``max_rounds`` ran and the rounds so far predict it
    ends within ``max_seconds`` of the start (warm-up included). ``sync`` runs after each call
    before the clock is read (default: ``torch.cuda.synchronize`` on a CUDA device). ``switch(key)`` runs
    before each call of ``runs[key]``, warm-up included, outside the timed span: for entries that take turns on
    one model (installing an entry's policy), so that no entry needs a model of its own.
    """
    if reference not in runs:
        raise ValueError(f"reference {reference!r} is not among the runs ({', '.join(runs)}); "
                         "fix: pass the name of one of them")
    if not 0 < confidence < 1 or rel_precision <= 0 or min_rounds < 1 or max_rounds < min_rounds:
        raise ValueError(f"compare: need 0 < confidence < 1, rel_precision > 0, 1 <= min_rounds <= max_rounds; "
                         f"got confidence={confidence}, rel_precision={rel_precision}, "
                         f"min_rounds={min_rounds}, max_rounds={max_rounds}")
    if until not in ("decided", "precise"):
        raise ValueError(f"compare: until must be 'decided' or 'precise', got {until!r}")
    sync = sync or _default_sync(device)

    def done(r: Ratio) -> bool:
        return r.decided if until == "decided" else r.within(rel_precision)

    def once(key: str) -> float:
        if switch is not None:
            switch(key)
        start = clock()
        runs[key]()
        sync()
        return (clock() - start) * 1e3

    start = clock()
    if warmup:
        for key, fn in runs.items():
            settle(fn, lambda _fn, key=key: once(key))
    keys = list(runs)
    samples: dict[str, list[float]] = {k: [] for k in keys}
    ratios: dict[str, Ratio] = {}
    capped_by: str | None = None
    rounds = 0
    gc_was_enabled = gc.isenabled()
    gc.disable()  # as timeit does: a collection inside one timed call is noise we cause ourselves
    try:
        rounds_started = clock()
        while True:
            if rounds >= min_rounds:
                if all(done(r) for r in ratios.values()):
                    break
                per_round = (clock() - rounds_started) / rounds
                if rounds >= max_rounds:
                    capped_by = "rounds"
                    break
                if together([float(clock() + per_round - start > max_seconds)])[0]:
                    capped_by = "seconds"
                    break
            times = {key: once(key) for key in _order(keys, rounds)}
            for key, ms in zip(times, together(list(times.values()))):
                samples[key].append(ms)
            rounds += 1
            ratios = {k: Ratio.of(samples[k], samples[reference], confidence, rel_precision)
                      for k in keys if k != reference}
    finally:
        if gc_was_enabled:
            gc.enable()
    return Comparison(reference, samples, ratios, rounds, clock() - start, confidence, rel_precision,
                      capped_by, {"rounds": max_rounds, "seconds": max_seconds}, until)


def settle(fn: Callable[[], Any], once: Callable[[Callable[[], Any]], float], min_runs: int = 1,
           max_runs: int = 12, tolerance: float = 0.15) -> float:
    """Run ``fn`` (timed by ``once``) until its last two times are within ``tolerance`` of the best so far;
    returns the best time. First calls build kernels, and on a virtual machine the first touches of fresh
    memory can be several times slower for a second or two, so a fixed single warm-up is not enough.
    Processes timing together (:func:`timed_together`) see each time as the slowest's, so they stop together."""
    times: list[float] = []
    while len(times) < max_runs:
        times.append(together([once(fn)])[0])
        best = min(times)
        if len(times) >= max(min_runs, 2) and all(t <= best * (1 + tolerance) for t in times[-2:]):
            break
    return min(times)
