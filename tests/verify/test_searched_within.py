"""A policy that is blanket autocast says what it rests on: where no policy the search tried met the budget on the
search batches (blanket autocast joins the ladder as a baseline, verified on the held-out batches alone), the
note and the report say so, and do not say "no per-layer policy measured faster"."""

from __future__ import annotations

from autoprec.measuring.budget import Budget
from autoprec.measuring.candidate import Candidate
from autoprec.outputs.results import decision
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import Precision
from autoprec.verify.end_to_end import Shortlist, Verification, _searched_within


def candidate(number: int) -> Candidate:
    return Candidate(number=number, assignment={"fc": "bf16"}, default="bf16", predicted_ms=1.0, metric=40.0,
                     sqnr_db=40.0, violation=0.0, seed="blanket" if number < 0 else "")


def test_only_the_blanket_baseline_in_the_ladder_is_no_search_within_the_budget():
    assert not _searched_within(Shortlist([candidate(-1)], Precision.BF16))
    assert _searched_within(Shortlist([candidate(-1), candidate(0)], Precision.BF16))  # a trial met it
    assert _searched_within(Shortlist([candidate(3)], Precision.BF16))


def verification(none_within: bool) -> Verification:
    samples = {"fp32": [10.0, 11.0], "autocast": [6.0, 7.0], "tuned": [6.0, 7.0]}
    return Verification(chosen=candidate(-1), policy=Policy(default="bf16"), samples=samples,
                        metric={"fp32": 0.0, "autocast": 53.1, "tuned": 53.1}, sqnr_db={"autocast": 53.1},
                        within_budget={"autocast": True, "tuned": True}, autocast_precision="bf16",
                        predicted_ms=1.0, timed_on="one forward", fidelity=True, tuned_is_autocast=True,
                        none_searched_within=none_within)


def test_the_report_says_the_search_found_nothing_within_the_budget_only_where_so():
    budget = Budget.parse(None, 38.5)
    said = decision(verification(True), budget)
    assert "no policy the search tried met it on the search batches" in said
    assert "no per-layer policy measured faster" not in said
    said = decision(verification(False), budget)
    assert "no per-layer policy measured faster" in said
    assert "search batches" not in said
