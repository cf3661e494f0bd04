"""Render the built site in a headless Chromium: every page of the nav must show its title and its code blocks.

    python docs/check_rendered.py [SITE] [--chromium /usr/bin/chromium]

`nox -s docs` runs it after ``mkdocs build --strict``. For each page of mkdocs.yml's nav it reads the Markdown
source: the title (its first ``# `` line) and every fenced code block. It serves SITE (default ``site``) on a
local port, opens each built page in Chromium (Debian's, driven by playwright; no browser is downloaded), and
fails unless the page's ``h1`` is visible and says the title, and each code block is visible with its text, in
the source's order. Requests that leave the local server (the theme's highlight.js on a CDN) are blocked, so a
page must show its code without them. Exits 1 naming every page that does not.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import re
import sys
import threading
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
#: Chromium's flags: headless, and nothing that reaches out or waits on a GPU.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
FENCE = re.compile(r"^(\s*)(```|~~~)")


def nav_pages(config: Path) -> list[str]:
    """The Markdown paths of mkdocs.yml's nav, in nav order (relative to docs/)."""
    # mkdocs.yml may hold !!python tags (none today): read it with a loader that ignores them.
    loader = type("Loader", (yaml.SafeLoader,), {})
    loader.add_multi_constructor("", lambda loader, suffix, node: None)
    nav = yaml.load(config.read_text(), Loader=loader)["nav"]
    pages: list[str] = []

    def walk(entry) -> None:
        if isinstance(entry, str):
            pages.append(entry)
        elif isinstance(entry, list):
            for each in entry:
                walk(each)
        elif isinstance(entry, dict):
            for each in entry.values():
                walk(each)

    walk(nav)
    return [page for page in pages if page.endswith(".md")]


def plain(text: str) -> str:
    """Text with runs of whitespace made one space, for comparing what the source says with what a page shows."""
    return " ".join(text.split())


def expected(markdown: str) -> tuple[str, list[str]]:
    """A page source's title (its first ``# `` heading, inline code marks dropped) and its code blocks' text."""
    title, blocks, lines, inside, indent = None, [], [], None, ""
    for line in markdown.splitlines():
        fence = FENCE.match(line)
        if inside is None:
            if fence:
                inside, indent, lines = fence.group(2), fence.group(1), []
            elif title is None and line.startswith("# "):
                title = line[2:].replace("`", "").strip()
        elif fence and fence.group(2) == inside and not line.strip()[3:].strip():
            blocks.append(plain("\n".join(each[len(indent):] if each.startswith(indent) else each for each in lines)))
            inside = None
        else:
            lines.append(line)
    if title is None:
        raise ValueError("no '# ' title")
    return title, [block for block in blocks if block]


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """``site`` on a free port of 127.0.0.1, from a thread; the server and its base URL."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address) -> None:
            if not isinstance(sys.exc_info()[1], ConnectionError):  # a request the browser dropped: nothing wrong
                super().handle_error(request, client_address)

    server = Server(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def page_url(base: str, page: str) -> str:
    """Where mkdocs (``use_directory_urls``) puts a page: ``guides/traces.md`` at ``guides/traces/``."""
    stem = page[: -len(".md")]
    if stem == "index" or stem.endswith("/index"):
        return base + stem[: -len("index")]
    return f"{base}{stem}/"


def check_page(browser_page, url: str, title: str, blocks: list[str]) -> list[str]:
    """What is wrong with the page at ``url``: a missing or hidden title, code blocks missing or hidden."""
    problems = []
    response = browser_page.goto(url, wait_until="load")
    if response is None or response.status != 200:
        return [f"{url} answered {response.status if response else 'nothing'}"]
    heading = browser_page.locator("[role=main] h1, .document h1, main h1").first
    if heading.count() == 0 or not heading.is_visible():
        problems.append("no visible h1")
    elif plain(heading.inner_text()).rstrip("¶ ").strip() != plain(title):
        problems.append(f"h1 says {plain(heading.inner_text())!r}, the source {title!r}")
    shown = [plain(pre.inner_text()) for pre in browser_page.locator("pre").all() if pre.is_visible()]
    position = 0
    for number, block in enumerate(blocks):
        found = next((index for index in range(position, len(shown)) if shown[index] == block), None)
        if found is None:
            hidden = any(plain(text) == block for text in browser_page.locator("pre").all_text_contents())
            problems.append(f"code block {number} ({block[:60]!r}...) is {'hidden' if hidden else 'not shown'}")
        else:
            position = found + 1
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", nargs="?", default=str(ROOT / "site"), help="the built site (mkdocs build)")
    parser.add_argument("--chromium", default="/usr/bin/chromium", help="the Chromium executable")
    parser.add_argument("--config", default=str(ROOT / "mkdocs.yml"))
    arguments = parser.parse_args(argv)
    from playwright.sync_api import sync_playwright

    site, docs = Path(arguments.site), Path(arguments.config).parent / "docs"
    pages = nav_pages(Path(arguments.config))
    server, base = serve(site)
    failures: dict[str, list[str]] = {}
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=arguments.chromium, headless=True, args=FLAGS)
            try:
                browser_page = browser.new_page()
                # Only the local server: the page must show its code without the theme's CDN scripts.
                browser_page.route(re.compile(r"^(?!http://127\.0\.0\.1:).*"), lambda route: route.abort())
                for page in pages:
                    title, blocks = expected((docs / page).read_text())
                    problems = check_page(browser_page, page_url(base, page), title, blocks)
                    if problems:
                        failures[page] = problems
                    print(f"{'FAIL' if problems else 'ok  '} {page}: {title!r}, {len(blocks)} code blocks")
            finally:
                browser.close()
    finally:
        server.shutdown()
    for page, problems in failures.items():
        for problem in problems:
            print(f"{page}: {problem}", file=sys.stderr)
    if failures:
        print(f"{len(failures)} of {len(pages)} pages do not show their title and code blocks", file=sys.stderr)
        return 1
    print(f"all {len(pages)} pages show their title and code blocks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
