"""README.md and docs/: every relative link resolves (the file exists; an `#anchor` names a heading of
the page it points to, by GitHub's slug rules), no page cites a tracker number in place of saying what
and why, and the README stays a short entry point. Plain text only: no JAX import."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
BLOCK = re.compile(r"<!-- (results/[\w./-]+\.md) -->\n.*?<!-- end \1 -->", re.S)
ISSUE = re.compile(r"\bissues?[\s_-]*#?\d+", re.I)


def _prose(text: str) -> str:
  """The text outside code fences and inline code spans (links there are not links)."""
  return CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
  """GitHub's anchor for a heading: inline markup dropped, lower case, punctuation removed (letters,
  digits, spaces, '-' and '_' kept), each space a '-'."""
  text = LINK.sub(lambda m: m.group(1), heading)
  text = re.sub(r"[`*]|<[^>]+>", "", text).strip().lower()
  text = re.sub(r"[^\w\- ]", "", text)
  return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
  """Every heading anchor of a markdown page, duplicates numbered as GitHub does (x, x-1, x-2, ...)."""
  seen: dict[str, int] = {}
  out = set()
  for line in FENCE.sub("", path.read_text()).splitlines():
    m = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
    if not m:
      continue
    base = slug(m.group(1))
    n = seen.get(base, 0)
    seen[base] = n + 1
    out.add(base if n == 0 else f"{base}-{n}")
  return out


def relative_links(path: Path) -> list[str]:
  return [t for _, t in LINK.findall(_prose(path.read_text())) if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def test_slug_follows_github():
  assert slug("Training on a TPU pod / multi-GPU host") == "training-on-a-tpu-pod--multi-gpu-host"
  assert slug("Layer scan and remat (compile only)") == "layer-scan-and-remat-compile-only"
  assert (
    slug("Model and training (`fpa_jax.models`, `fpa_jax.train`)") == "model-and-training-fpa_jaxmodels-fpa_jaxtrain"
  )
  assert slug("What `bash run.sh quickstart` prints") == "what-bash-runsh-quickstart-prints"
  assert slug("See [the ops](docs/ops.md)!") == "see-the-ops"


def test_anchors_number_duplicate_headings(tmp_path):
  page = tmp_path / "x.md"
  page.write_text("# A\n## Setup\n```\n# not a heading\n```\n## Setup\n")
  assert anchors(page) == {"a", "setup", "setup-1"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
  bad = []
  for target in relative_links(page):
    file, _, anchor = target.partition("#")
    dest = (page.parent / file).resolve() if file else page
    if not dest.exists():
      bad.append(f"{target}: no such file")
    elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
      bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
  assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_tracker_numbers(page):
  """Say what and why, not "issue N". Blocks between results markers are copied from files other
  scripts write: those scripts answer for them."""
  hits = ISSUE.findall(BLOCK.sub("", page.read_text()))
  assert not hits, f"{page.relative_to(ROOT)} cites {hits}: say what and why instead"


@pytest.mark.parametrize("sub", ["fpa_jax", "notebooks", "experiments", "tests"])
def test_no_tracker_numbers_in_the_package_or_notebooks(sub):
  """The package's code and messages, the notebooks, studies and tests: the same rule as the docs."""
  files = [p for p in sorted((ROOT / sub).rglob("*")) if p.suffix in (".py", ".ipynb")]
  bad = [f"{p.relative_to(ROOT)}: {hits}" for p in files if (hits := ISSUE.findall(p.read_text()))]
  assert files and not bad, "say what and why instead: " + "; ".join(bad)


def test_readme_is_an_entry_point():
  lines = (ROOT / "README.md").read_text().splitlines()
  assert len(lines) <= 300, f"README.md has {len(lines)} lines: move detail to docs/"
  commands = [ln.split("#")[0].strip() for ln in lines[2:5]]
  assert lines[2] == "```bash" and commands[1:] == ["bash run.sh quickstart", "bash run.sh test"], lines[:6]
  text = "\n".join(lines)
  assert "pip install -e ." in text and "pip install -r requirements.txt" in text
  assert "<!-- results/claims.md -->" in text and "docs/" in text
