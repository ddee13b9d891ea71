"""``autoprec tune`` killed (SIGKILL) during its search and run again with the same command chooses what an uncut
tune chooses: one process trial for trial, two torchrun processes the same policy. The kill lands in the seed walk's
last greedy step, or in the first sampled trial (the model's planted fault: tests/torchrun_models/model.py).

Before: a step lost to the kill counted against --trials, so the rerun ran one trial fewer than an uncut tune and
chose from fewer (the issue's ``bf16 + {cancel: fp32, head: fp32}`` where an uncut tune gives ``{cancel: fp32}``);
a rerun's sampler started its random stream over, so it proposed other trials than an uncut run's.
"""

from __future__ import annotations

import shutil

import pytest
from test_distributed_tune import MODEL, _rules, _trials, cut_and_rerun, side_by_side

pytestmark = pytest.mark.slow

# forwards after the first finished trial before the kill: each trial runs the 3 search batches once
IN_THE_WALK = 12  # the walk's last greedy step (trial 5)
IN_THE_SAMPLING = 15  # the first sampled trial (trial 6)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Each cut tune and its rerun, side by side (``side_by_side``): name -> (cut, what it left, rerun, folder)."""
    def new():
        folder = tmp_path_factory.mktemp("job")
        shutil.copy(MODEL, folder / "model.py")
        return folder

    def left(run):
        return (run / "policy.json").exists(), _trials(run)

    runs = {(0, after): cut_and_rerun(new(), left, 0, KILL_RANK="0", RANK="0", FAULT_AFTER=str(after))
            for after in (IN_THE_WALK, IN_THE_SAMPLING)}
    runs[2, IN_THE_SAMPLING] = cut_and_rerun(new(), left, 2, KILL_RANK="0", FAULT_AFTER=str(IN_THE_SAMPLING))
    with side_by_side(runs) as finished:
        yield finished


@pytest.mark.parametrize("fault_after", [IN_THE_WALK, IN_THE_SAMPLING])
def test_one_process_killed_in_the_search_reruns_to_the_uncut_trials(resumed, single_run, fault_after):
    done, (chose, trials), again, folder = resumed((0, fault_after))
    assert done.returncode != 0 and not chose
    assert 0 < len(trials) < len(_trials(single_run))

    assert again.returncode == 0, again.stderr[-3000:]
    assert [params for _, params in _trials(folder / "run")] == [params for _, params in _trials(single_run)]
    assert _rules(folder / "run") == _rules(single_run)


def test_two_ranks_with_rank_0_killed_in_the_sampling_rerun_to_the_uncut_policy(resumed, single):
    done, (chose, _), again, folder = resumed((2, IN_THE_SAMPLING))
    assert done.returncode != 0 and not chose
    assert again.returncode == 0, again.stderr[-3000:]
    assert _rules(folder / "run") == single
