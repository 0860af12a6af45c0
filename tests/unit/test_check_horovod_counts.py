"""tools/check_horovod_counts.py: a run of Horovod's tests is compared with docs/compatibility.md's table."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "check_horovod_counts.py")


def check(tmp_path, text, *extra):
    log = tmp_path / "run.log"
    log.write_text(text)
    return subprocess.run([sys.executable, TOOL, str(log), *extra], capture_output=True, text=True)


def test_counts_as_recorded_pass_and_a_worse_file_fails(tmp_path):
    same = check(tmp_path, "== test_torch.py\n....\n3 failed, 100 passed, 12 skipped, 407 warnings in 17.41s\n"
                           "3 failed, 100 passed, 12 skipped, 407 warnings in 17.48s\n"
                           "== test_timeline.py\n1 passed in 2.00s\n")
    assert same.returncode == 0, same.stdout + same.stderr
    assert "test_torch.py: 100 passed, 3 failed" in same.stdout
    worse = check(tmp_path, "== test_torch.py\n4 failed, 99 passed, 12 skipped in 17.41s\n")
    assert worse.returncode == 1 and "WORSE" in worse.stdout and "test_torch.py" in worse.stderr
    unknown = check(tmp_path, "== test_new.py\n1 failed, 1 passed in 1.00s\n")
    assert unknown.returncode == 0 and "not in docs/compatibility.md" in unknown.stdout


def test_summaries_with_subtests_and_warnings_are_read(tmp_path):
    done = check(tmp_path, "== test_tensorflow.py\n4 failed, 143 passed, 112 skipped, 134 warnings, 172 subtests "
                           "passed in 123.56s (0:02:03)\n")
    assert done.returncode == 0 and "test_tensorflow.py: 143 passed, 4 failed, 112 skipped;" in done.stdout
