"""Two fixes to the CLI reference page that mkdocs-click renders from the click commands (``reference/cli.md``).

- Help texts are plain text, not Markdown: a placeholder such as ``CSINODE_GUARD_<OPTION>`` reaches the page as an
  HTML tag and vanishes. Angle-bracketed upper-case placeholders are escaped.
- With click 8.3 an option without a default reports click's internal ``Sentinel.UNSET``, which mkdocs-click prints
  as the default; the page shows ``-`` (no default) instead.
"""

from __future__ import annotations

import re
from typing import Any

PAGE = "reference/cli.md"
PLACEHOLDER = re.compile(r"<([A-Z][A-Z0-9_]*)>")


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """mkdocs hook: the rendered HTML of the CLI reference, fixed as described above."""
    if page.file.src_uri != PAGE:
        return html
    html = PLACEHOLDER.sub(r"&lt;\1&gt;", html)
    return html.replace("<code>Sentinel.UNSET</code>", "-")
