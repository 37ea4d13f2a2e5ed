"""Copy results tables into README.md, so every number there comes from a file a script wrote.

    python -m experiments.update_readme

README.md marks each table as

    <!-- results/NAME.md -->
    ...replaced...
    <!-- end results/NAME.md -->

and this script replaces what lies between with the current contents of results/NAME.md.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- (results/[\w./-]+\.md) -->\n)(.*?)(<!-- end \2 -->)", re.S)


def render(readme: str, root: Path = ROOT) -> str:
  def fill(m):
    src = root / m.group(2)
    body = src.read_text() if src.exists() else f"(not yet generated: run the script that writes {m.group(2)})\n"
    return m.group(1) + body + m.group(4)
  return BLOCK.sub(fill, readme)


def main():
  path = ROOT / "README.md"
  old = path.read_text()
  new = render(old)
  path.write_text(new)
  print(f"README.md: {len(BLOCK.findall(new))} results blocks, {'updated' if new != old else 'unchanged'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
