"""Sphinx configuration of jzero's documentation (built by ``bash scripts/docs.sh``).

Offline by design: no intersphinx, no remote assets. Markdown pages are read by MyST; the
API reference comes from the docstrings (autodoc + napoleon, Google style). Before reading
the pages, the build writes ``docs/_generated``: the benchmark tables and figures from
``benchmarks/*.json`` (``scripts/figures.py``) and the design page's module map from the
package's docstrings.
"""

import ast
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path

from sphinx.ext.napoleon.docstring import GoogleDocstring

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # importing jzero for autodoc touches no GPU

project = "jzero"
author = "jzero contributors"
copyright = "jzero contributors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_generated/*.md", "README.md"]

myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = False
napoleon_use_rtype = False

# Every cross-reference must resolve (warnings are errors in scripts/docs.sh). The build is
# offline, so names from other libraries cannot: they are listed here, nothing else is.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|optax|flax|numpy|np|jnp|orbax|chex|equinox|ml_dtypes)(\..*)?"),
    (r"py:.*", r"(typing|collections\.abc|pathlib|os|logging|dataclasses|types)\..*"),
    (r"py:.*", r"(Any|Callable|Sequence|Mapping|Iterator|Iterable|Literal|NamedTuple)"),
    (r"py:.*", r"(Path|PathLike|Mesh|PartitionSpec|NamedSharding|ShapeDtypeStruct)"),
    (r"py:.*", r"(GradientTransformation|Array|ArrayLike|PyTree|DTypeLike|Device|Module)"),
    (r"py:class", r"(object|int|float|str|bool|bytes|dict|list|tuple|type|None|Ellipsis)"),
    (r"py:exc", r"(ValueError|TypeError|RuntimeError|KeyError|OSError|FileNotFoundError)"),
]

html_theme = "furo"
html_title = "jzero"
html_show_sourcelink = False
pygments_style = "friendly"
pygments_dark_style = "monokai"

# The documented packages and the public names each re-exports (``from .x import y as y``).
PUBLIC_MODULES = [
    "jzero",
    "jzero.linen",
    "jzero.nnx",
    "jzero.checkpoint",
    "jzero.distributed",
    "jzero.config",
]


def _public_names() -> dict[int, str]:
    """``id(object) -> 'jzero.Name'`` for every object a documented package exports."""
    names: dict[int, str] = {}
    for modname in PUBLIC_MODULES:
        module = importlib.import_module(modname)
        for name, obj in vars(module).items():
            if not name.startswith("_") and not isinstance(obj, type(module)):
                names.setdefault(id(obj), f"{modname}.{name}")
    return names


def _import(target: str):
    """The object a dotted name denotes, or None."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


def _contexts(node) -> list[str]:
    """Where a reference was written: the documented object's dotted name and module
    (a docstring's relative names, ``:class:`Stored``` or ``:mod:`.comm.buckets```, are
    relative to its module), most specific first."""
    names = []
    source = node.source or ""
    if "docstring of " in source:
        names.append(source.rsplit("docstring of ", 1)[1])
    if node.get("py:module"):
        names.append(".".join(filter(None, [node["py:module"], node.get("py:class")])))
    contexts = []
    for name in names:
        obj = _import(name)
        module = getattr(obj, "__module__", None)
        for dotted in filter(None, [name, module]):
            parts = dotted.split(".")
            contexts += [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    return list(dict.fromkeys(contexts))


def _resolve_internal(app, env, node, contnode):
    """Docstrings name objects where they are defined (``jzero.core.plan.ZeroState``, or
    relative to their module); the reference documents them where they are exported
    (``jzero.ZeroState``): link there. A real jzero object or module the reference does
    not document (an internal module such as ``jzero.core.comm.quantize``, a type alias)
    is shown as code, unlinked. Anything else (a typo, an unknown name) stays unresolved,
    and the strict build fails on it."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~")
    relative = target.lstrip(".")
    candidates = [target] if target.startswith("jzero") else []
    candidates += [f"{ctx}.{relative}" for ctx in _contexts(node)]
    for candidate in candidates:
        obj = _import(candidate)
        if obj is None:
            continue
        public = app.config._jzero_public.get(id(obj))
        if public is not None and public != target:
            domain = env.get_domain("py")
            return domain.resolve_xref(
                env, node["refdoc"], app.builder, node["reftype"], public, node, contnode
            )
        return contnode
    documented = [name for name in env.get_domain("py").objects if name.endswith(f".{relative}")]
    if len(documented) == 1:  # e.g. LossScale, named in a module that does not import it
        domain = env.get_domain("py")
        return domain.resolve_xref(
            env, node["refdoc"], app.builder, node["reftype"], documented[0], node, contnode
        )
    return None


_original_inline_attribute = GoogleDocstring._consume_inline_attribute


def _inline_attribute(self):
    """Napoleon reads ``X: y`` at the start of a property's docstring as its type; jzero's
    property docstrings are sentences ('G: the devices of one data group ...') and their
    types are annotations, which autodoc shows. Keep a property's sentence whole."""
    _type, descs = _original_inline_attribute(self)
    if _type and self._what == "property":
        return "", [f"{_type}: {descs[0]}", *descs[1:]] if descs else [_type]
    return _type, descs


GoogleDocstring._consume_inline_attribute = _inline_attribute


def _skip_foreign_attribute(app, what, name, obj, skip, options):
    """A dataclass field whose default is another library's object (``Precision``'s
    ``param_dtype = jnp.float32``) would be documented with that object's docstring, and
    twice: the class's ``Attributes:`` section documents it already."""
    if what == "class" and isinstance(obj, type) and not obj.__module__.startswith("jzero"):
        return True
    return None


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


def write_module_table(out: Path) -> None:
    """``_generated/modules.md``: every module of the package with the first paragraph of
    its docstring, read from the source (nothing imported), so the design page's map of
    the code cannot go stale."""
    rows = ["| module | what it holds |", "|---|---|"]
    for path in sorted((ROOT / "jzero").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        text = re.sub(r":\w+:`[~.]*([^`]+)`", r"`\1`", _first_paragraph(doc))
        text = text.replace("|", "\\|")
        rows.append(f"| `{name}` | {text} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(rows) + "\n", encoding="utf-8")


def write_figures(out: Path) -> None:
    """The benchmark tables and plots, from ``benchmarks/*.json`` (``scripts/figures.py``),
    written at every build so that no page shows numbers older than the JSON."""
    spec = importlib.util.spec_from_file_location("figures", ROOT / "scripts" / "figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    figures.generate(out)


def setup(app):
    generated = Path(__file__).parent / "_generated"
    write_module_table(generated / "modules.md")
    write_figures(generated)
    app.config._jzero_public = _public_names()
    app.connect("missing-reference", _resolve_internal)
    app.connect("autodoc-skip-member", _skip_foreign_attribute)
