"""The layout stays what docs/architecture.md says: no module past 450 lines (the CRD's schema text aside), and
every module of operator/, trainer/, store/, hack/ and cli/ named there, so a newcomer finds each rule by its file name."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIMIT = 450
EXEMPT = {"operator/ddp_operator/crd.py"}  # the CRD's schema, described field by field
ROOTS = ["operator/ddp_operator", "trainer/ddp_trainer", "store/ddp_store", "hack", "cli/kubectl_ddp"]


def modules() -> list[Path]:
    return sorted(p for root in ROOTS for p in (REPO / root).rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_is_past_the_size_limit():
    big = {str(p.relative_to(REPO)): n for p in modules()
           if (n := len(p.read_text().splitlines())) > LIMIT and str(p.relative_to(REPO)) not in EXEMPT}
    assert not big, f"modules past {LIMIT} lines (split them along their own seams): {big}"


def test_every_module_is_on_the_architecture_page():
    page = (REPO / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(REPO)) for p in modules()
               if p.name != "__init__.py" and p.name not in page and f"`{p.stem}" not in page]
    assert not missing, f"docs/architecture.md does not name: {missing}"
