"""What a streamed tune says when it has no plan: for a --target, nothing estimated faster there (not "timed here",
nor advice to pass the --target it was given)."""

from pathlib import Path

from autoprec.runtime.policy import Policy
from autoprec.stream.run import StreamedResult, print_streamed


def _printed(capsys, result_fields: dict, timed_on: str | None) -> str:
    policy = Policy()
    policy.result = result_fields
    print_streamed(StreamedResult(policy, {}, {"fp32": 1.0}, "fp32", [], {}, Path("nowhere"), timed_on))
    return capsys.readouterr().out


def test_no_plan_for_a_target_names_the_target(capsys):
    out = _printed(capsys, {"estimated_for": "h100", "mode": "streamed"}, None)
    assert "estimated faster than fp32 for h100: fp32" in out
    assert "--target" not in out and "timed faster than fp32 here" not in out


def test_no_plan_timed_here_says_here_and_how_to_plan_for_a_gpu(capsys):
    out = _printed(capsys, {"predicted_from": "each layer timed here", "mode": "streamed"}, "cpu")
    assert "timed faster than fp32 here (tune with --target NAME to plan for a GPU): fp32" in out
