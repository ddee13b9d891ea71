"""The output folder: autoprec writes only into a folder that is new, empty or its own (issue 15)."""

from __future__ import annotations

import pytest

from autoprec.outputs.outdir import LOCK_NAME, MARKER_NAME, OutDirError, claim_out_dir


def test_a_new_folder_is_claimed_and_marked_and_can_be_claimed_again(tmp_path):
    out = tmp_path / "run"
    with claim_out_dir(out):
        (out / "report.md").write_text("autoprec's report\n")
        (out / "notes-of-a-later-version.txt").write_text("an output this version does not know\n")
    assert (out / MARKER_NAME).exists()
    with claim_out_dir(out):  # resuming into its own folder: fine, whatever autoprec left there
        pass


def test_a_folder_with_the_users_own_files_is_refused_and_left_alone(tmp_path):
    (tmp_path / "report.md").write_text("# my notes\n")
    (tmp_path / "data.csv").write_text("1,2\n")
    with pytest.raises(OutDirError, match=r"already holds files that autoprec did not write \(data\.csv\); "
                                          r"give a new or empty folder"):
        with claim_out_dir(tmp_path):
            pass
    assert (tmp_path / "report.md").read_text() == "# my notes\n"
    assert not (tmp_path / MARKER_NAME).exists() and not (tmp_path / LOCK_NAME).exists()


def test_a_lone_report_md_is_the_users(tmp_path):
    (tmp_path / "report.md").write_text("# my notes\n")
    with pytest.raises(OutDirError, match=r"\(report\.md\)"):
        with claim_out_dir(tmp_path):
            pass


@pytest.mark.parametrize("names", [("profile.json", "study.db", "policy.json", "report.md", "pareto.png",
                                    "sensitivity.png", LOCK_NAME), ("study.db",), (LOCK_NAME,)])
def test_a_folder_from_an_autoprec_before_the_marker_is_still_its_own(tmp_path, names):
    for name in names:
        (tmp_path / name).write_text("")
    with claim_out_dir(tmp_path):
        pass
    assert (tmp_path / MARKER_NAME).exists()
