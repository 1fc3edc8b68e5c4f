"""The documentation cannot rot: the README is a landing page whose links
resolve, the generated references equal what the config model and the CLI
say, and the snippets marked runnable run."""

import contextlib
import importlib.util
import io
import os
import re
import shlex

import pytest

from ds_tsp import cli
from ds_tsp.config import _EXPECTED, TSPConfig
from scripts import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "examples/README.md"] + sorted(
    f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md"))
LINK = re.compile(r"\]\(([^)\s]+)\)")
RUNNABLE = re.compile(r"<!-- runnable -->\n```(python|bash)\n(.*?)```", re.S)


def _read(page):
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


def _generator():
    spec = importlib.util.spec_from_file_location("generate_reference", os.path.join(ROOT, "docs",
                                                                                     "generate_reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_is_a_landing_page():
    text = _read("README.md")
    lines = text.splitlines()
    print(f"README.md: {len(lines)} lines")
    assert len(lines) <= 150
    assert lines[:5] == ["# ds_tsp", "", "```bash",
                         "make demo   # install, then train a small Llama-shaped model with TSP on 2 ranks under "
                         "the deepspeed launcher",
                         "make test   # install, then run the quick tier: every entry point and block kind at TSP 2 "
                         "(CPU, gloo ranks)"]
    assert "make test-all  # the whole suite, as CI runs it (.ci/run)" in lines[5:8]
    assert "make test-all" in _read(".ci/run")


@pytest.mark.parametrize("page", PAGES)
def test_every_link_resolves_to_a_file_in_the_repository(page):
    targets = [t for t in LINK.findall(_read(page)) if not re.match(r"[a-z]+://|#|mailto:", t)]
    missing = [t for t in targets
               if not os.path.exists(os.path.normpath(os.path.join(ROOT, os.path.dirname(page), t.split("#")[0])))]
    print(f"{page}: {len(targets)} links")
    assert not missing, f"{page} links to {missing}"


def test_the_generated_references_are_the_committed_ones(monkeypatch):
    generator = _generator()
    monkeypatch.setenv("COLUMNS", generator.HELP_WIDTH)
    for name, page in generator.PAGES.items():
        assert page() == _read(f"docs/{name}"), f"docs/{name} is stale: run python docs/generate_reference.py"


def test_every_tsp_key_has_a_description_and_its_valid_values():
    descriptions = _generator().field_docstrings(TSPConfig)
    for key in TSPConfig.model_fields:
        assert len(descriptions.get(key, "")) > 20, f"tsp.{key} has no docstring in ds_tsp/config.py"
        assert key in _EXPECTED, f"tsp.{key} has no valid values in ds_tsp.config._EXPECTED"
        assert f"| `{key}` |" in _read("docs/configuration.md")


def _runnable_snippets():
    return [(page, kind, body) for page in PAGES for kind, body in RUNNABLE.findall(_read(page))]


def test_there_are_runnable_snippets():
    kinds = {kind for _, kind, _ in _runnable_snippets()}
    assert kinds == {"python", "bash"}


@pytest.mark.parametrize("page, kind, body", _runnable_snippets(),
                         ids=[f"{page}-{i}" for i, (page, _, _) in enumerate(_runnable_snippets())])
def test_a_runnable_snippet_runs(page, kind, body, tmp_path):
    if kind == "python":
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        (tmp_path / "snippet.py").write_text(body)
        proc = run_script([tmp_path / "snippet.py"], cwd=tmp_path, env=env, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        print(proc.stdout[-500:])
        return
    for line in body.strip().splitlines():
        argv = shlex.split(line, comments=True)
        assert argv[0] == "ds-tsp", f"only ds-tsp commands run in-process here: {line}"
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = cli.main(argv[1:])
        print(out.getvalue()[-400:])
        assert status == 0 and out.getvalue(), line


def test_the_api_page_names_every_public_name_and_every_deprecated_path():
    import ds_tsp
    import ds_tsp.checkpoint
    from test_package import OLD_PATHS
    text = _read("docs/api.md")
    unnamed = [name for name in ds_tsp.__all__ + ds_tsp.checkpoint.__all__ if f"`{name}`" not in text]
    unlisted = [old for old, new in OLD_PATHS.items() if f"| `{old}` | `{new}` |" not in text]
    assert not unnamed and not unlisted, (unnamed, unlisted)
