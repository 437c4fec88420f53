"""docs/DDTREE.md is the output of tools/ddtree_walkthrough.py: one greedy DDTree round of the shipped pair."""
import difflib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "DDTREE.md"
COMMAND = "python tools/ddtree_walkthrough.py > docs/DDTREE.md"


def test_page_is_current():
    run = subprocess.run([sys.executable, "tools/ddtree_walkthrough.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    committed = PAGE.read_text() if PAGE.exists() else ""
    if run.stdout != committed:
        diff = difflib.unified_diff(committed.splitlines(), run.stdout.splitlines(), "docs/DDTREE.md",
                                    "tools/ddtree_walkthrough.py", lineterm="", n=1)
        raise AssertionError(f"docs/DDTREE.md is stale: run {COMMAND} (from the repository root)\n"
                             + "\n".join(list(diff)[:40]))


def test_page_shows_decoded_tokens():
    """Tokens appear as decoded text, never as byte-level BPE symbols."""
    text = PAGE.read_text()
    assert not any(symbol in text for symbol in ("Ġ", "Ċ", "ĉ")), "byte-level BPE symbols in docs/DDTREE.md"
