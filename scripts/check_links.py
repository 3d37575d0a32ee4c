"""Checks every internal link of the built documentation, offline.

Sphinx's ``linkcheck`` builder needs the network; this reads the HTML that
``scripts/docs.sh`` built and checks each local ``href`` / ``src``: the file it names
exists and, for ``page.html#anchor``, the page has an element with that ``id``. External
links (``http:``, ``https:``, ``mailto:``) are listed with ``--external`` but not fetched.

    python scripts/check_links.py docs/_build/html
"""

from __future__ import annotations

import argparse
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class _Page(HTMLParser):
    """The links and the element ids of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (tag == "a" and name == "name"):
                self.ids.add(value)
            elif name in ("href", "src"):
                self.links.append(value)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def is_external(url: str) -> bool:
    return urlsplit(url).scheme in ("http", "https", "mailto", "ftp") or url.startswith("//")


def broken_links(root: Path) -> list[str]:
    """``'page.html: link (why)'`` for every internal link of the site at ``root`` that
    does not resolve; empty when all do."""
    root = root.resolve()  # the keys, as each link's resolved target is looked up
    pages = {p: _parse(p) for p in sorted(root.rglob("*.html"))}
    broken = []
    for page_path, page in pages.items():
        for link in page.links:
            if is_external(link) or link.startswith(("data:", "javascript:")):
                continue
            parts = urlsplit(link)
            target = page_path if not parts.path else (page_path.parent / unquote(parts.path))
            target = target.resolve()
            where = f"{page_path.relative_to(root)}: {link}"
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{where} (no file {target})")
                continue
            if parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{where} (no id '{parts.fragment}' in {target.name})")
    return broken


def external_links(root: Path) -> list[str]:
    """Every distinct external link of the site, sorted."""
    return sorted({u for p in root.rglob("*.html") for u in _parse(p).links if is_external(u)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("html", type=Path, help="the built site, e.g. docs/_build/html")
    parser.add_argument("--external", action="store_true", help="list external links too")
    args = parser.parse_args(argv)
    if not (args.html / "index.html").exists():
        print(f"{args.html} has no index.html: build the site first (bash scripts/docs.sh).")
        return 2
    broken = broken_links(args.html)
    for line in broken:
        print(f"broken: {line}")
    if args.external:
        print("\n".join(external_links(args.html)))
    pages = len(list(args.html.rglob("*.html")))
    print(f"{pages} pages, {len(broken)} broken internal links")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
