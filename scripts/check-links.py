#!/usr/bin/env python3
"""Why: the docs are split by purpose over many files (README.md, docs/**), and code
comments name docs by path; a moved section or a renamed file must not leave a link
that leads nowhere. `make lint` runs this.

Checks, from the repository root (or the directory given as the first argument):
  - every relative link and image in every Markdown file (git's tracked and new files,
    else every *.md outside target/ and .git/): the file or directory it names exists,
    and a `#anchor` into a Markdown file (or the same file) is one of its headings'
    anchors, made by GitHub's rules (below) or given as `<a id|name="...">`;
  - every path of a Markdown file under docs/ (with its `#anchor`, if any) named in the sources
    (src/, crates/, tests/, benches/, scripts/, the Makefile, .ci/).
Links to http(s), mailto and other schemes are not followed. Links in fenced code
blocks and code spans are not links. Exits 1 listing `file:line: message` for each
broken one, 0 when there is none.

GitHub's anchor for a heading: the heading's text as rendered (code spans, emphasis
and link syntax removed), lower-cased; every character that is not a letter, a digit,
`_`, `-` or a space dropped; spaces turned into `-`. A repeated anchor in one file
gets `-1`, `-2`, ... Standard library only (python3), like the other scripts.
"""

import os
import re
import subprocess
import sys
from functools import lru_cache

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
HTML_ANCHOR = re.compile(r"<a\s+[^>]*?(?:id|name)\s*=\s*\"([^\"]+)\"", re.I)
# [text](target) and ![alt](target); the text may hold code spans and brackets one deep.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(\S+)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
DOC_PATH = re.compile(r"docs/[A-Za-z0-9_./-]*?\.md(?:#[A-Za-z0-9_-]+)?")
SOURCE_DIRS = ["src", "crates", "tests", "benches", "scripts", ".ci"]
SOURCE_FILES = ["Makefile"]
SOURCE_EXTS = (".rs", ".sh", ".py", ".toml", ".yaml", ".yml")
SKIP_DIRS = {".git", "target", ".cluster", "node_modules"}


def slug(text):
    """GitHub's anchor for a heading's source text."""
    text = CODE_SPAN.sub(lambda m: m.group(2), text)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("*", "")
    text = re.sub(r"(?<![\w])_+|_+(?![\w])", "", text)  # _emphasis_, not snake_case
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def markdown_lines(path):
    """(line number, text) of the lines outside fenced code blocks."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    fence = None
    for number, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            continue
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            continue
        yield number, line


@lru_cache(maxsize=None)
def anchors(path):
    """Every anchor a Markdown file offers."""
    found, seen = set(), {}
    previous = ""
    for _, line in markdown_lines(path):
        for m in HTML_ANCHOR.finditer(line):
            found.add(m.group(1))
        text = None
        m = HEADING.match(line)
        if m:
            text = m.group(2)
        elif SETEXT.match(line) and previous.strip() and not previous.startswith((" ", "|", "-", "*")):
            text = previous.strip()
        previous = line
        if text is None:
            continue
        base = slug(text)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return frozenset(found)


def check_target(root, source, target, where, errors):
    """One link target, relative to the file `source` (a path below root)."""
    if target.startswith("<") and target.endswith(">"):
        target = target[1:-1]
    if not target or SCHEME.match(target) or target.startswith("//"):
        return
    path, _, anchor = target.partition("#")
    path = path.split("?")[0]
    if path.startswith("/"):
        resolved = os.path.normpath(os.path.join(root, path.lstrip("/")))
    elif path:
        resolved = os.path.normpath(os.path.join(root, os.path.dirname(source), path))
    else:
        resolved = os.path.join(root, source)
    rel = os.path.relpath(resolved, root)
    if rel.startswith(".."):
        errors.append(f"{where}: {target}: leaves the repository")
        return
    if not os.path.exists(resolved):
        errors.append(f"{where}: {target}: no such file or directory ({rel})")
        return
    if anchor and resolved.endswith(".md") and os.path.isfile(resolved):
        if anchor not in anchors(resolved):
            errors.append(f"{where}: {target}: no heading with anchor #{anchor} in {rel}")


def check_markdown(root, source, errors):
    for number, line in markdown_lines(os.path.join(root, source)):
        where = f"{source}:{number}"
        unspanned = CODE_SPAN.sub(lambda m: "\0" * len(m.group(0)), line)
        for m in INLINE_LINK.finditer(unspanned):
            check_target(root, source, m.group(1), where, errors)
        m = REF_DEF.match(unspanned)
        if m:
            check_target(root, source, m.group(1), where, errors)


def check_sources(root, errors):
    files = [f for f in SOURCE_FILES if os.path.isfile(os.path.join(root, f))]
    for top in SOURCE_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for name in sorted(filenames):
                if name.endswith(SOURCE_EXTS) or top == ".ci":
                    files.append(os.path.relpath(os.path.join(dirpath, name), root))
    for source in files:
        try:
            with open(os.path.join(root, source), encoding="utf-8") as f:
                lines = f.read().split("\n")
        except (UnicodeDecodeError, OSError):
            continue
        for number, line in enumerate(lines, 1):
            for m in DOC_PATH.finditer(line):
                check_target(root, "", m.group(0), f"{source}:{number}", errors)


def markdown_files(root):
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "*.md"],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout.split("\n")
        return sorted(p for p in out if p and os.path.isfile(os.path.join(root, p)))
    except (OSError, subprocess.CalledProcessError):
        found = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
            found += [os.path.relpath(os.path.join(dirpath, n), root) for n in filenames if n.endswith(".md")]
        return sorted(found)


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".")
    errors = []
    files = markdown_files(root)
    for source in files:
        check_markdown(root, source, errors)
    check_sources(root, errors)
    for e in errors:
        print(e)
    if errors:
        print(f"{len(errors)} broken links", file=sys.stderr)
        return 1
    print(f"links ok: {len(files)} Markdown files and the docs/ paths named in the sources")
    return 0


if __name__ == "__main__":
    sys.exit(main())
