"""What scripts/gpu_lease.sh needs of the tree, checked without a GPU."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CALL = 64 * 2**20
"""What one device call carries: every file of the tree plus the lease's carry (``.lease/``)."""
CARRY = int(42.7 * 2**20)
"""``.lease/`` as ``gpu_lease.sh carry`` made it on 2026-12-02: the base model in fp16, the corpus, bm25s."""
MARGIN = 2 * 2**20
"""Room for what a session adds before the next lease (its raw results, a pinned value)."""


def test_the_tree_leaves_a_gpu_call_room_for_the_lease_carry():
    """A tree past ``CALL - CARRY`` makes every call of the next GPU lease fail before it starts
    (``travel`` in the script refuses it), in a session that may be the only one with a GPU for days."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=False,
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    paths = [ROOT / name for name in listed.stdout.decode().split("\0") if name]
    size = sum(path.stat().st_size for path in paths if path.is_file())
    assert size <= CALL - CARRY - MARGIN, (
        f"the tree is {size / 2**20:.1f} MiB: beside the lease's {CARRY / 2**20:.1f} MiB carry it leaves "
        f"less than {MARGIN / 2**20:.0f} MiB of a GPU call's 64; `git rm` raw data or weights no run needs "
        "(git keeps them)"
    )
