"""The documentation cannot drift from the code.

- Every ```python block of each guide (``docs/guides/*.md``), the home page and the README
  runs, in order, in one namespace per page, on the 8 CPU devices of ``conftest.py`` (in a
  temporary directory). A block whose info string says ``norun`` is only compiled (it
  needs a cluster or another process layout, and the page says so); one that says
  ``multiprocess`` runs as a script in 2 real processes on 127.0.0.1. A page whose run,
  as the user makes it, is too long for CI runs smaller (:data:`SMALLER`): the values
  CI gives are here, not in the page's code or text.
- Every ``jzero.*`` name any of those blocks uses exists.
- Every name a documented package exports is on the API reference pages.
- The benchmark figures come from the committed JSON: ``scripts/figures.py`` writes one
  table row per run, and the README's committed figure was drawn from today's JSON.
- The offline link checker finds broken links and anchors.

Nothing here reads the prose: no test pins a sentence or a typed number.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import sys
import textwrap
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from _multiprocess import run_processes
from _paths import REPO

import jzero

ROOT = REPO
DOCS = ROOT / "docs"
GUIDES = sorted((DOCS / "guides").glob("*.md"))
PAGES = [ROOT / "README.md", DOCS / "index.md", *GUIDES]
PUBLIC = {  # the documented packages and the file that lists each one's exports
    "jzero": "jzero/__init__.py",
    "jzero.linen": "jzero/linen.py",
    "jzero.nnx": "jzero/nnx.py",
    "jzero.checkpoint": "jzero/checkpoint/__init__.py",
    "jzero.distributed": "jzero/distributed/__init__.py",
    "jzero.config": "jzero/config/__init__.py",
    "jzero.accounting": "jzero/accounting/__init__.py",
    "jzero.autoconfig": "jzero/autoconfig/__init__.py",
}
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,})(?P<info>[^`]*)$")


class Block(NamedTuple):
    line: int  # 1-based line of the block's first code line in the page
    flags: frozenset[str]  # the info string's words after "python": norun, multiprocess
    code: str


def python_blocks(page: Path) -> list[Block]:
    """The page's fenced ```python blocks, in order."""
    blocks, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        info, fence, start = m["info"].split(), m["fence"], i + 1
        i = start
        while i < len(lines) and lines[i].strip() != fence:
            i += 1
        if info and info[0] == "python":
            code = textwrap.dedent("\n".join(lines[start:i]))
            blocks.append(Block(start + 1, frozenset(info[1:]), code))
        i += 1
    return blocks


def _compile(page: Path, block: Block, names: dict[str, Any] | None = None):
    """The block's code object; ``names``: values for the ``NAME = ...`` statements at its
    top level, in place of the page's (the names found are removed from ``names``)."""
    # Padded with newlines so that a traceback names the page's own line numbers.
    tree = ast.parse("\n" * (block.line - 1) + block.code)
    for node in tree.body if names else ():
        target = node.targets[0] if isinstance(node, ast.Assign) else None
        if isinstance(target, ast.Name) and target.id in names:
            node.value = ast.copy_location(ast.Constant(names.pop(target.id)), node.value)
    return compile(tree, str(page), "exec")


class Smaller(NamedTuple):
    """How CI runs a page whose run, as the user makes it, would take CI too long."""

    names: dict[str, Any]  # values for NAME = ... statements of the page's code
    keywords: dict[str, dict[str, Any]]  # jzero function -> keywords added to its calls


SMALLER = {
    # Llama 3's 8 B at every stage: a dozen GPU compiles of minutes each on CI's 2 cores;
    # the tiny model at stage 1, under a budget that cuts its micro-batch: 2 compiles.
    "docs/guides/plan_gpu.md": Smaller(
        names={"SIZE": "tiny"},
        keywords={"autoconfigure": {"stages": (1,), "device_budget": 18e6}},
    ),
}
"""The pages CI runs smaller than the user's run, and how."""


def _run_smaller(smaller: Smaller, monkeypatch) -> list[str]:
    """Adds ``smaller``'s keywords to the jzero functions' calls; returns the names of the
    calls, one per call, as they are made."""
    calls: list[str] = []
    for name, keywords in smaller.keywords.items():
        monkeypatch.setattr(jzero, name, _adding(getattr(jzero, name), keywords, calls))
    return calls


def _adding(function: Any, keywords: dict[str, Any], calls: list[str]) -> Any:
    def call(*args, **kwargs):
        calls.append(function.__name__)
        return function(*args, **kwargs | keywords)

    return call


def _page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def test_every_guide_has_code_and_known_flags():
    assert len(GUIDES) >= 10, GUIDES
    for page in PAGES:
        blocks = python_blocks(page)
        assert blocks, f"{_page_id(page)} has no python block"
        for block in blocks:
            unknown = block.flags - {"norun", "multiprocess"}
            assert not unknown, f"{_page_id(page)}:{block.line}: unknown flags {unknown}"
            _compile(page, block)  # every block is valid Python, run or not
        runs = [b for b in blocks if "norun" not in b.flags]
        assert runs, f"{_page_id(page)}: no block runs"


def _attribute_chains(tree: ast.AST) -> set[str]:
    """Every dotted name ``jzero.a.b`` the code reads (and its prefixes)."""
    chains = set()
    for node in ast.walk(tree):
        parts, cur = [], node
        while isinstance(cur, ast.Attribute):
            parts.append(cur.attr)
            cur = cur.value
        if parts and isinstance(cur, ast.Name) and cur.id == "jzero":
            chains.add(".".join(["jzero", *reversed(parts)]))
    return chains


def _resolves(dotted: str) -> bool:
    obj = jzero
    for part in dotted.split(".")[1:]:
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_jzero_names_in_code_exist(page):
    """Also for the blocks that only compile: a renamed function fails here."""
    used = set()
    for block in python_blocks(page):
        used |= _attribute_chains(ast.parse(block.code))
    missing = sorted(name for name in used if not _resolves(name))
    assert not missing, f"{_page_id(page)} uses names jzero does not have: {missing}"


def _run_multiprocess(page: Path, block: Block, tmp_path: Path) -> None:
    script = tmp_path / "guide_script.py"
    script.write_text("\n" * (block.line - 1) + block.code)
    done = run_processes(script, 2, local_devices=4, timeout=240)
    for i, d in enumerate(done):
        assert d.returncode == 0, (
            f"{_page_id(page)}:{block.line}: process {i} exited {d.returncode}\n"
            f"{d.stdout[-3000:]}\n{d.stderr[-6000:]}"
        )


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_page_code_runs(page, tmp_path, monkeypatch):
    """Each page's blocks in order, one namespace, in a fresh directory (checkpoints and
    files the guides write land there); a page of :data:`SMALLER` as CI runs it, every one
    of its names and functions found (else CI would run the user's size)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    smaller = SMALLER.get(_page_id(page), Smaller({}, {}))
    names, calls = dict(smaller.names), _run_smaller(smaller, monkeypatch)
    namespace = {"__name__": "__guide__"}
    ran = 0
    for block in python_blocks(page):
        if "norun" in block.flags:
            continue
        if "multiprocess" in block.flags:
            _run_multiprocess(page, block, tmp_path)
        else:
            exec(_compile(page, block, names), namespace)  # noqa: S102
        ran += 1
    assert ran > 0
    assert names == {}, f"{_page_id(page)} no longer assigns {sorted(names)}: update SMALLER"
    assert set(calls) == set(smaller.keywords), f"{_page_id(page)} calls no {smaller.keywords}"


# ----------------------------------------------------------------------- API reference
def exports(module: str) -> list[str]:
    """The names a package re-exports, Equinox-style: ``from .x import y as y``."""
    tree = ast.parse((ROOT / PUBLIC[module]).read_text())
    return [
        alias.asname
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.asname == alias.name
    ]


def documented() -> set[str]:
    """Every object the API pages document (autodoc or explicit ``py:`` directives)."""
    names = set()
    directive = re.compile(r"^\.\. (?:auto|py:)(?:class|function|exception|data)::\s+(\S+)")
    for page in (DOCS / "api").glob("*.md"):
        for line in page.read_text().splitlines():
            if m := directive.match(line.strip()):
                names.add(m[1])
    return names


def test_every_export_is_in_the_api_reference():
    docs = documented()
    assert "jzero.ZeroOptimizer" in docs  # the parse found the pages
    missing = []
    for module in PUBLIC:
        names = exports(module)
        assert names, module
        for name in names:
            if isinstance(getattr(sys.modules[module], name), type(jzero)):
                continue  # a subpackage: it has its own page
            if f"{module}.{name}" not in docs:
                missing.append(f"{module}.{name}")
    assert not missing, f"exports missing from docs/api/*.md: {missing}"


def test_every_subpackage_export_has_a_page():
    pages = {p.stem for p in (DOCS / "api").glob("*.md")}
    subpackages = [n for n in exports("jzero") if isinstance(getattr(jzero, n), type(jzero))]
    assert sorted(subpackages) == ["autoconfig", "checkpoint", "distributed", "linen", "nnx"]
    assert set(subpackages) <= pages and {"config", "accounting"} <= pages


# ----------------------------------------------------------------------------- figures
def _figures():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "scripts" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _table_rows(markdown: str) -> list[list[str]]:
    rows = [line for line in markdown.splitlines() if line.startswith("|")]
    return [[c.strip() for c in r.strip("|").split("|")] for r in rows[2:]]  # no head, rule


def test_figures_are_generated_from_the_committed_json(tmp_path):
    figures = _figures()
    written = figures.generate(tmp_path)
    assert {p.name for p in written} >= {
        "bench_runs.md", "bench_targets.md", "max_model.md", "main_job.md", "stages_cpu8.png",
        "runs_cpu8.png", "memory_vs_devices.png", "max_model_cpu8.png",
    }  # fmt: skip
    bench = json.loads((ROOT / "benchmarks" / "bench_cpu8.json").read_text())
    rows = _table_rows((tmp_path / "bench_runs.md").read_text())
    assert [r[0] for r in rows] == [f"`{r['name']}`" for r in bench["runs"]]
    for row, run in zip(rows, bench["runs"]):  # MB = 1e6, as the header says
        assert float(row[1].replace(",", "")) == round(run["model_state_bytes_per_device"] / 1e6, 1)
        assert float(row[4].replace(",", "")) == round(run["peak_bytes_per_device"] / 1e6, 1)
        assert float(row[5].replace(",", "")) == round(run["device_peak_bytes_per_device"] / 1e6, 1)
        assert int(row[9]) == run["collectives_per_step"]
    targets = (tmp_path / "bench_targets.md").read_text().splitlines()[1:-1]
    bench_targets = figures._load_script("benchmark.targets")
    assert targets == bench_targets.checks(bench)  # the script's own checks, not typed
    mm = json.loads((ROOT / "benchmarks" / "max_model_cpu8.json").read_text())
    mm_rows = _table_rows((tmp_path / "max_model.md").read_text())
    assert [int(r[1]) for r in mm_rows] == [s["layers"] for s in mm["max_model"]["stages"]]
    tag = figures.source_tag(ROOT / "benchmarks" / "bench_cpu8.json")
    assert _png_text(tmp_path / "stages_cpu8.png")["Source"] == tag
    matrices = json.loads((ROOT / "benchmarks" / "matrices_cpu8.json").read_text())["matrices"]
    cells = [
        row[3].split(" -> ")[-1] for row in _table_rows((tmp_path / "matrices.md").read_text())
    ]
    assert cells == [f"{r['comm_ratio']:.2f}" for r in matrices]


def _png_text(path: Path) -> dict[str, str]:
    from PIL import Image

    with Image.open(path) as image:
        return dict(image.text)


def test_readme_figure_was_drawn_from_the_committed_json():
    """The README shows a committed PNG (GitHub cannot run the script): it must carry the
    hash of today's ``bench_cpu8.json``; regenerate it with
    ``python scripts/figures.py --headline docs/figures/stages_cpu8.png``."""
    readme = (ROOT / "README.md").read_text()
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", readme)
    assert images == ["docs/figures/stages_cpu8.png"]
    tag = _figures().source_tag(ROOT / "benchmarks" / "bench_cpu8.json")
    assert _png_text(ROOT / images[0]).get("Source") == tag, (
        "docs/figures/stages_cpu8.png is out of date: python scripts/figures.py "
        "--headline docs/figures/stages_cpu8.png"
    )


def test_readme_fits_two_screens():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


# -------------------------------------------------------------------------- link check
def _check_links():
    path = ROOT / "scripts" / "check_links.py"
    spec = importlib.util.spec_from_file_location("check_links", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_link_checker_finds_broken_links_and_anchors(tmp_path, monkeypatch):
    (tmp_path / "guides").mkdir()
    (tmp_path / "index.html").write_text(
        '<a href="guides/a.html#there">ok</a> <a href="guides/a.html#nowhere">bad id</a>'
        ' <a href="missing.html">bad file</a> <a href="https://example.org/x">external</a>'
        ' <img src="guides/fig.png"> <a href="#top">self</a><h1 id="top">t</h1>'
    )
    (tmp_path / "guides" / "a.html").write_text('<h2 id="there">x</h2><a href="../index.html">')
    (tmp_path / "guides" / "fig.png").write_bytes(b"")
    checker, parsed = _check_links(), []
    parse = checker._parse
    checker._parse = lambda path: parsed.append(path) or parse(path)
    monkeypatch.chdir(tmp_path)
    broken = checker.broken_links(Path("."))  # relative, as scripts/docs.sh passes it
    # Each page once (a linked page was parsed again per anchor: 3 minutes for the site).
    assert sorted(parsed) == sorted(tmp_path.resolve().rglob("*.html"))
    assert broken == [
        "index.html: guides/a.html#nowhere (no id 'nowhere' in a.html)",
        f"index.html: missing.html (no file {tmp_path.resolve() / 'missing.html'})",
    ]


def test_readme_gpu_paragraph_is_generated_from_the_committed_json():
    """The README states what the lent GPU measured from ``benchmarks/gpu_check.json``;
    regenerate it with ``python scripts/figures.py --readme README.md``."""
    gpu = json.loads((ROOT / "benchmarks" / "gpu_check.json").read_text())
    block = _figures().readme_block(gpu)
    assert block in (ROOT / "README.md").read_text(), (
        "README.md's GPU paragraph is out of date: python scripts/figures.py --readme README.md"
    )
    assert "not yet measured on a GPU" not in (ROOT / "README.md").read_text()


def test_the_gpu_summary_says_what_ran_and_what_has_no_figures():
    figures = _figures()
    gpu = {
        "dry_run": False,
        "machine": {"device_kind": "NVIDIA H100", "jax": "0.11.2"},
        "pieces": {
            "n1": {"ran_at": "2026-12-01T10:00:00", "targets": [
                {"status": "PASS", "measured": 1.004}, {"status": "FAIL", "measured": 1.031}]},
            "quant": {"ran_at": "2026-12-01T11:00:00", "error": "timed out", "targets": []},
            "offload_fixed": {"parts": {"streamed": {"error": "timed out"}}, "targets": []},
            # retired pieces (compile-only facts, now asserted in CI) are not listed
            "table2": {"ran_at": "2026-12-01T11:00:00", "error": "timed out", "targets": []},
            "mock8": {"parts": {"overlap": {"error": "timed out"}}, "targets": []},
        },
    }  # fmt: skip
    text = figures.gpu_summary_md(gpu)
    assert text.startswith(
        "`scripts/gpu_check.sh` ran on a lent NVIDIA H100 (jax 0.11.2, 2026-12-01"
    )
    assert "stages 0-3 cost 1.004-1.031 x plain `jit`'s step." in text
    assert text.endswith("No figures yet: `quant`, `offload_fixed:streamed`.")
    assert figures.gpu_summary_md(gpu | {"dry_run": True}).startswith("No GPU has run")
    assert figures.gpu_summary_md(None).startswith("No GPU has run")
