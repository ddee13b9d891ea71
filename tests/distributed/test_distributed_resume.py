"""``autoprec tune`` killed (SIGKILL) during its search and run again with the same command chooses what an uncut
tune chooses: one process trial for trial, two torchrun processes the same policy. The kill lands in the seed walk's
last greedy step, or in the first sampled trial (the model's planted fault: tests/torchrun_models/model.py).

Before: a step lost to the kill counted against --trials, so the rerun ran one trial fewer than an uncut tune and
chose from fewer (the issue's ``bf16 + {cancel: fp32, head: fp32}`` where an uncut tune gives ``{cancel: fp32}``);
a rerun's sampler started its random stream over, so it proposed other trials than an uncut run's.
"""

from __future__ import annotations

import pytest
from test_distributed_tune import ARGS, _rules, _run, _trials

pytestmark = pytest.mark.slow

# forwards after the first finished trial before the kill: each trial runs the 3 search batches once
IN_THE_WALK = 12  # the walk's last greedy step (trial 5)
IN_THE_SAMPLING = 15  # the first sampled trial (trial 6)


@pytest.mark.parametrize("fault_after", [IN_THE_WALK, IN_THE_SAMPLING])
def test_one_process_killed_in_the_search_reruns_to_the_uncut_trials(folder, single_run, fault_after):
    done = _run(folder, *ARGS, "--out", "run", RUN_DIR="run", KILL_RANK="0", RANK="0", FAULT_AFTER=str(fault_after))
    assert done.returncode != 0 and not (folder / "run" / "policy.json").exists()
    assert 0 < len(_trials(folder / "run")) < len(_trials(single_run))

    again = _run(folder, *ARGS, "--out", "run")
    assert again.returncode == 0, again.stderr[-3000:]
    assert [params for _, params in _trials(folder / "run")] == [params for _, params in _trials(single_run)]
    assert _rules(folder / "run") == _rules(single_run)


def test_two_ranks_with_rank_0_killed_in_the_sampling_rerun_to_the_uncut_policy(folder, single):
    done = _run(folder, *ARGS, "--out", "run", ranks=2, RUN_DIR="run", KILL_RANK="0", FAULT_AFTER=str(IN_THE_SAMPLING))
    assert done.returncode != 0 and not (folder / "run" / "policy.json").exists()
    again = _run(folder, *ARGS, "--out", "run", ranks=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _rules(folder / "run") == single
