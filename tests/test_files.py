"""scripts.py: writes that leave the old file or dir whole when cut short."""

import pytest
from dflash_reference import scripts



def test_replace_dir_never_leaves_a_dir_half_replaced(tmp_path):
    """scripts.replace_dir: a write that fails leaves the old dir whole; a run killed between its two
    renames (the old dir aside, the new one not yet in) has the old dir put back by the next run; leftovers
    that are links or files are removed, not followed."""
    place = tmp_path / "case"
    place.mkdir()
    (place / "a").write_text("old")

    def failing(d):
        d.mkdir()
        (d / "a").write_text("half")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        scripts.replace_dir(place, failing)
    assert (place / "a").read_text() == "old" and (tmp_path / "case.partial").is_dir()
    place.rename(tmp_path / "case.old")                        # killed between the renames
    seen = []
    with pytest.raises(KeyboardInterrupt):
        scripts.replace_dir(place, lambda d: seen.append((place / "a").read_text()) or failing(d))
    assert seen == ["old"] and (place / "a").read_text() == "old" and not (tmp_path / "case.old").exists()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("mine")
    scripts.remove(tmp_path / "case.partial")
    (tmp_path / "case.partial").symlink_to(elsewhere)           # leftovers that are a link and a file
    (tmp_path / "case.old").write_text("x")

    def new(d):
        d.mkdir()
        (d / "a").write_text("new")
    scripts.replace_dir(place, new)
    assert (place / "a").read_text() == "new" and (elsewhere / "keep").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["case", "elsewhere"]
