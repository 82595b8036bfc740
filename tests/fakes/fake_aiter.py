"""The strict AITER fakes as one installable ``aiter`` package.

``install(arch="gfx942")`` puts the fake package into ``sys.modules`` and
points ``torch.ops.aiter`` at its ops, as importing real AITER would; it works
in a test and in an engine subprocess (put ``tests/fakes`` on ``sys.path``
first).  ``uninstall()`` on the returned handle restores what was there.  The
fakes' sources: ``aiter_export.py`` (the export), ``aiter_mla.py`` (the MLA op),
``aiter_fa.py`` (the AITER FA backend's varlen / unified / paged attention calls).
"""

from __future__ import annotations

from aiter_export import AiterExport
from aiter_fa import install_fa_fakes
from aiter_mla import install_mla_fakes

__all__ = ["FakeAiter", "install"]


class FakeAiter(AiterExport):
    """An ``AiterExport`` with the series' AITER calls registered; ``mla_op``
    records the MLA op's calls, ``fa`` the AITER FA calls."""

    def __init__(self, arch: str = "gfx942"):
        super().__init__()
        self.arch = arch
        self.mla_op = install_mla_fakes(self, arch)
        self.fa = install_fa_fakes(self, arch)


def install(arch: str = "gfx942") -> FakeAiter:
    return FakeAiter(arch).install()
