"""docs/DESIGN.md is the project's copy of the design it is built against: every section of the shared design, word
for word, plus what this project adds (marked "this project")."""

import pytest
from conftest import REPO_ROOT

SHARED_DESIGN = REPO_ROOT.parent / "shared" / "DESIGN.md"


def test_the_projects_design_holds_every_section_of_the_shared_one():
    if not SHARED_DESIGN.exists():
        pytest.skip(f"no shared design at {SHARED_DESIGN} (a clone outside the development workspace)")
    ours = (REPO_ROOT / "docs" / "DESIGN.md").read_text()
    shared = SHARED_DESIGN.read_text()
    sections = ["## " + part if i else part for i, part in enumerate(shared.split("\n## "))]
    missing = [section.splitlines()[0] for section in sections if section.strip() not in ours]
    assert not missing, f"docs/DESIGN.md lacks or changed these sections of {SHARED_DESIGN}: {missing}"
