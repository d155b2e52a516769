"""The patterns of the names artifacts are filed under (a recipe's name, a sha256 hex digest), and
the largest index entry either side reads.

The domain (recipe, artifact, entry) and the store both check them; they live here, in a leaf
module, so that the domain need not import the store package.
"""

from __future__ import annotations

import re

HEX64 = re.compile(r"^[0-9a-f]{64}\Z")
# A recipe's name, as recipes spell it; it names store paths too (index/<recipe>/<key>.json).
NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,99}$")  # as the recipe schema spells it (ECMA: no \Z)

# An index entry holds artifact.json (45,000 files take 9.7 MB): one larger is refused unread.
MAX_INDEX_BYTES = 64 << 20

__all__ = ["HEX64", "MAX_INDEX_BYTES", "NAME"]
