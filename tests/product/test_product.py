"""The product as a newcomer meets it: the README's CPU quick start runs as written, the docs
and the README's performance table match the results files, and nothing in the product
narrates its own history or points outside the repository."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# what the product's text is: code, tests, docs, examples, benchmark scripts, the README
PRODUCT = ([*ROOT.glob("moestream/**/*.py"), *ROOT.glob("moestream/tools/sim/data/*.json"),
            *ROOT.glob("tests/*.py"), *ROOT.glob("docs/*.md"), *ROOT.glob("examples/*.py"),
            *ROOT.glob("benchmarks/*.py"), *ROOT.glob("benchmarks/*.sh"), README])
HISTORY = re.compile("[Ss]ession" + r"[ _-]?[0-9]")
OUTSIDE = re.compile(r"\.\./shared|benchmarks/NOTES\.md|results/" + "session")


def test_no_line_narrates_a_work_session_or_points_outside_the_repo():
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in PRODUCT
            for n, line in enumerate(p.read_text().splitlines(), 1)
            if HISTORY.search(line) or OUTSIDE.search(line)]
    assert not hits, "\n".join(hits[:20])


def test_readme_is_short_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    for link in re.findall(r"\]\(([^)#]+)\)", text):
        if not link.startswith("http"):
            assert (ROOT / link).exists(), link


def test_docs_are_reference_sized_and_their_local_links_resolve():
    for doc in ROOT.glob("docs/*.md"):
        assert doc.stat().st_size <= 24_000, doc.name
        for link in re.findall(r"\]\(([^)#]+)\)", doc.read_text()):
            if not link.startswith("http"):
                assert (doc.parent / link).exists(), f"{doc.name}: {link}"


def _cpu_quick_start() -> str:
    text = README.read_text()
    section = text[text.index("## Quick start on a CPU"):]
    return section[section.index("```python\n") + len("```python\n"):section.index("```\n")]


@pytest.mark.slow
def test_readme_cpu_quick_start_runs_as_written(tmp_path):
    script = tmp_path / "quick_start.py"
    script.write_text(_cpu_quick_start())
    env_path = str(ROOT)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path,
                         env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin",
                              "CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 0, res.stderr[-3000:]
    errors = [float(m) for m in re.findall(r"rel error ([0-9.e+-]+)", res.stdout)]
    assert len(errors) == 2 and all(e < 1e-2 for e in errors), res.stdout


def test_performance_doc_and_readme_table_match_the_results_files():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "performance.py"),
                          "--check"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr


def test_package_modules_are_short_and_the_layer_never_imports_its_tools():
    long = [f"{p.relative_to(ROOT)}: {n}" for p in ROOT.glob("moestream/**/*.py")
            if (n := len(p.read_text().splitlines())) > 800]
    assert not long, long
    # statically: no module outside moestream/tools imports it ...
    pattern = re.compile(r"^\s*(from\s+(moestream\.tools|\.+tools)\b|import\s+moestream\.tools)",
                         re.M)
    users = [str(p.relative_to(ROOT)) for p in ROOT.glob("moestream/**/*.py")
             if "tools" not in p.relative_to(ROOT).parts and pattern.search(p.read_text())]
    assert not users, users
    # ... and at run time: importing the layer loads none of it
    code = ("import sys, moestream, moestream.integrations.transformers; "
            "print(sorted(m for m in sys.modules if m.startswith('moestream.tools')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.strip()
    assert out == "[]", out
